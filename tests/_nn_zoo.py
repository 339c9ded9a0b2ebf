"""torch.nn's module zoo with small constructor arguments and inputs (used by tests/integration/test_nn_zoo.py).

SPECS maps a class name to (constructor, inputs): ``inputs()`` returns the positional arguments of one forward
(float tensors are made fp32; the opt level casts them). NOT_MODULES are the torch.nn classes that are not
layers to run (abstract bases, wrappers, containers without forward); EXPECTED_FAILURES name what cannot run
under a level, with the reason (docs/coverage.md repeats them).
"""
import torch
import torch.nn as nn


def r(*shape):
    return torch.randn(*shape)


def ids(*shape, high=5):
    return torch.randint(0, high, shape)


def _lazy(cls, *args, **kw):
    return lambda: cls(*args, **kw)


def _act(shape=(2, 6)):
    return lambda: (r(*shape),)


C1, C2, C3 = (lambda: (r(2, 3, 8),)), (lambda: (r(2, 3, 6, 6),)), (lambda: (r(1, 3, 4, 4, 4),))
PAIR = lambda: (r(4, 5), r(4, 5))  # noqa: E731

SPECS = {
    # convolutions and transposed convolutions (lazy ones infer their input channels)
    "Conv1d": (_lazy(nn.Conv1d, 3, 4, 3), C1), "Conv2d": (_lazy(nn.Conv2d, 3, 4, 3), C2),
    "Conv3d": (_lazy(nn.Conv3d, 3, 2, 3), C3), "ConvTranspose1d": (_lazy(nn.ConvTranspose1d, 3, 4, 3), C1),
    "ConvTranspose2d": (_lazy(nn.ConvTranspose2d, 3, 4, 3), C2),
    "ConvTranspose3d": (_lazy(nn.ConvTranspose3d, 3, 2, 3), C3),
    "LazyConv1d": (_lazy(nn.LazyConv1d, 4, 3), C1), "LazyConv2d": (_lazy(nn.LazyConv2d, 4, 3), C2),
    "LazyConv3d": (_lazy(nn.LazyConv3d, 2, 3), C3), "LazyConvTranspose1d": (_lazy(nn.LazyConvTranspose1d, 4, 3), C1),
    "LazyConvTranspose2d": (_lazy(nn.LazyConvTranspose2d, 4, 3), C2),
    "LazyConvTranspose3d": (_lazy(nn.LazyConvTranspose3d, 2, 3), C3),
    "Fold": (_lazy(nn.Fold, (4, 4), 2), lambda: (r(2, 12, 9),)), "Unfold": (_lazy(nn.Unfold, 2), C2),
    # linear layers
    "Linear": (_lazy(nn.Linear, 6, 4), _act()), "LazyLinear": (_lazy(nn.LazyLinear, 4), _act()),
    "Bilinear": (_lazy(nn.Bilinear, 6, 5, 4), lambda: (r(2, 6), r(2, 5))), "Identity": (nn.Identity, _act()),
    # pools
    "AvgPool1d": (_lazy(nn.AvgPool1d, 2), C1), "AvgPool2d": (_lazy(nn.AvgPool2d, 2), C2),
    "AvgPool3d": (_lazy(nn.AvgPool3d, 2), C3), "MaxPool1d": (_lazy(nn.MaxPool1d, 2), C1),
    "MaxPool2d": (_lazy(nn.MaxPool2d, 2), C2), "MaxPool3d": (_lazy(nn.MaxPool3d, 2), C3),
    "AdaptiveAvgPool1d": (_lazy(nn.AdaptiveAvgPool1d, 3), C1),
    "AdaptiveAvgPool2d": (_lazy(nn.AdaptiveAvgPool2d, 3), C2),
    "AdaptiveAvgPool3d": (_lazy(nn.AdaptiveAvgPool3d, 2), C3),
    "AdaptiveMaxPool1d": (_lazy(nn.AdaptiveMaxPool1d, 3), C1),
    "AdaptiveMaxPool2d": (_lazy(nn.AdaptiveMaxPool2d, 3), C2),
    "AdaptiveMaxPool3d": (_lazy(nn.AdaptiveMaxPool3d, 2), C3),
    "LPPool1d": (_lazy(nn.LPPool1d, 2, 2), C1), "LPPool2d": (_lazy(nn.LPPool2d, 2, 2), C2),
    "LPPool3d": (_lazy(nn.LPPool3d, 2, 2), C3),
    "FractionalMaxPool2d": (_lazy(nn.FractionalMaxPool2d, 2, output_size=3), C2),
    "FractionalMaxPool3d": (_lazy(nn.FractionalMaxPool3d, 2, output_size=2), C3),
    "MaxUnpool1d": (_lazy(nn.MaxUnpool1d, 2), lambda: nn.functional.max_pool1d(r(2, 3, 8), 2, return_indices=True)),
    "MaxUnpool2d": (_lazy(nn.MaxUnpool2d, 2), lambda: nn.functional.max_pool2d(r(2, 3, 6, 6), 2, return_indices=True)),
    "MaxUnpool3d": (_lazy(nn.MaxUnpool3d, 2),
                    lambda: nn.functional.max_pool3d(r(1, 3, 4, 4, 4), 2, return_indices=True)),
    # normalization
    "BatchNorm1d": (_lazy(nn.BatchNorm1d, 3), C1), "BatchNorm2d": (_lazy(nn.BatchNorm2d, 3), C2),
    "BatchNorm3d": (_lazy(nn.BatchNorm3d, 3), C3), "LazyBatchNorm1d": (nn.LazyBatchNorm1d, C1),
    "LazyBatchNorm2d": (nn.LazyBatchNorm2d, C2), "LazyBatchNorm3d": (nn.LazyBatchNorm3d, C3),
    "InstanceNorm1d": (_lazy(nn.InstanceNorm1d, 3, affine=True), C1),
    "InstanceNorm2d": (_lazy(nn.InstanceNorm2d, 3, affine=True), C2),
    "InstanceNorm3d": (_lazy(nn.InstanceNorm3d, 3, affine=True), C3),
    "LazyInstanceNorm1d": (_lazy(nn.LazyInstanceNorm1d, affine=True), C1),
    "LazyInstanceNorm2d": (_lazy(nn.LazyInstanceNorm2d, affine=True), C2),
    "LazyInstanceNorm3d": (_lazy(nn.LazyInstanceNorm3d, affine=True), C3),
    "GroupNorm": (_lazy(nn.GroupNorm, 1, 3), C2), "LayerNorm": (_lazy(nn.LayerNorm, 6), _act()),
    "RMSNorm": (_lazy(nn.RMSNorm, 6), _act()), "LocalResponseNorm": (_lazy(nn.LocalResponseNorm, 2), C2),
    "CrossMapLRN2d": (_lazy(nn.CrossMapLRN2d, 3), C2), "SyncBatchNorm": (_lazy(nn.SyncBatchNorm, 3), C2),
    # dropout
    "Dropout": (nn.Dropout, _act()), "Dropout1d": (nn.Dropout1d, C1), "Dropout2d": (nn.Dropout2d, C2),
    "Dropout3d": (nn.Dropout3d, C3), "AlphaDropout": (nn.AlphaDropout, _act()),
    "FeatureAlphaDropout": (nn.FeatureAlphaDropout, C2),
    # embeddings
    "Embedding": (_lazy(nn.Embedding, 5, 4), lambda: (ids(2, 3),)),
    "EmbeddingBag": (_lazy(nn.EmbeddingBag, 5, 4), lambda: (ids(2, 3),)),
    # recurrent
    "RNN": (_lazy(nn.RNN, 6, 4), lambda: (r(3, 2, 6),)), "LSTM": (_lazy(nn.LSTM, 6, 4), lambda: (r(3, 2, 6),)),
    "GRU": (_lazy(nn.GRU, 6, 4), lambda: (r(3, 2, 6),)), "RNNCell": (_lazy(nn.RNNCell, 6, 4), _act()),
    "LSTMCell": (_lazy(nn.LSTMCell, 6, 4), _act()), "GRUCell": (_lazy(nn.GRUCell, 6, 4), _act()),
    # attention and transformers
    "MultiheadAttention": (_lazy(nn.MultiheadAttention, 8, 2), lambda: (r(3, 2, 8), r(3, 2, 8), r(3, 2, 8))),
    "TransformerEncoderLayer": (_lazy(nn.TransformerEncoderLayer, 8, 2, 16), lambda: (r(3, 2, 8),)),
    "TransformerDecoderLayer": (_lazy(nn.TransformerDecoderLayer, 8, 2, 16), lambda: (r(3, 2, 8), r(4, 2, 8))),
    "TransformerEncoder": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2,
                                                         enable_nested_tensor=False), lambda: (r(3, 2, 8),)),
    "TransformerDecoder": (lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 2),
                           lambda: (r(3, 2, 8), r(4, 2, 8))),
    "Transformer": (_lazy(nn.Transformer, 8, 2, 1, 1, 16), lambda: (r(3, 2, 8), r(4, 2, 8))),
    # shape and padding
    "Flatten": (nn.Flatten, C2), "Unflatten": (_lazy(nn.Unflatten, 1, (2, 3)), _act()),
    "PixelShuffle": (_lazy(nn.PixelShuffle, 2), lambda: (r(1, 8, 3, 3),)),
    "PixelUnshuffle": (_lazy(nn.PixelUnshuffle, 2), C2), "ChannelShuffle": (_lazy(nn.ChannelShuffle, 2),
                                                                             lambda: (r(1, 4, 3, 3),)),
    "Upsample": (_lazy(nn.Upsample, scale_factor=2), C2),
    "UpsamplingNearest2d": (_lazy(nn.UpsamplingNearest2d, scale_factor=2), C2),
    "UpsamplingBilinear2d": (_lazy(nn.UpsamplingBilinear2d, scale_factor=2), C2),
    "CosineSimilarity": (nn.CosineSimilarity, PAIR), "PairwiseDistance": (nn.PairwiseDistance, PAIR),
    "Sequential": (lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU()), _act()),
    "AdaptiveLogSoftmaxWithLoss": (_lazy(nn.AdaptiveLogSoftmaxWithLoss, 6, 10, [4]),
                                   lambda: (r(4, 6), ids(4, high=10))),
    # activations with arguments
    "GLU": (nn.GLU, _act()), "Softmax": (_lazy(nn.Softmax, -1), _act()), "Softmin": (_lazy(nn.Softmin, -1), _act()),
    "LogSoftmax": (_lazy(nn.LogSoftmax, -1), _act()), "Softmax2d": (nn.Softmax2d, C2),
    "Threshold": (_lazy(nn.Threshold, 0.1, 0.0), _act()), "PReLU": (nn.PReLU, _act()),
    # losses
    "BCELoss": (nn.BCELoss, lambda: (torch.rand(4, 5), torch.rand(4, 5))),
    "CrossEntropyLoss": (nn.CrossEntropyLoss, lambda: (r(4, 5), ids(4))),
    "NLLLoss": (nn.NLLLoss, lambda: (r(4, 5), ids(4))),
    "NLLLoss2d": (nn.NLLLoss2d, lambda: (r(2, 5, 3, 3), ids(2, 3, 3))),
    "MultiMarginLoss": (nn.MultiMarginLoss, lambda: (r(4, 5), ids(4))),
    "MultiLabelMarginLoss": (nn.MultiLabelMarginLoss, lambda: (r(4, 5), ids(4, 5))),
    "MultiLabelSoftMarginLoss": (nn.MultiLabelSoftMarginLoss,
                                 lambda: (r(4, 5), torch.randint(0, 2, (4, 5)).float())),
    "CTCLoss": (nn.CTCLoss, lambda: (r(6, 2, 5).log_softmax(-1), torch.randint(1, 5, (2, 3)),
                                     torch.tensor([6, 6]), torch.tensor([3, 2]))),
    "GaussianNLLLoss": (nn.GaussianNLLLoss, lambda: (r(4, 5), r(4, 5), torch.rand(4, 5) + 0.1)),
    "MarginRankingLoss": (nn.MarginRankingLoss, lambda: (r(4), r(4), torch.randint(0, 2, (4,)).float() * 2 - 1)),
    "CosineEmbeddingLoss": (nn.CosineEmbeddingLoss, lambda: (r(4, 5), r(4, 5), torch.tensor([1.0, -1, 1, -1]))),
    "HingeEmbeddingLoss": (nn.HingeEmbeddingLoss, lambda: (r(4, 5), torch.randint(0, 2, (4, 5)).float() * 2 - 1)),
    "TripletMarginLoss": (nn.TripletMarginLoss, lambda: (r(4, 5), r(4, 5), r(4, 5))),
    "TripletMarginWithDistanceLoss": (nn.TripletMarginWithDistanceLoss, lambda: (r(4, 5), r(4, 5), r(4, 5))),
    "KLDivLoss": (_lazy(nn.KLDivLoss, reduction="batchmean"), lambda: (r(4, 5).log_softmax(-1), torch.rand(4, 5))),
    "PoissonNLLLoss": (nn.PoissonNLLLoss, lambda: (r(4, 5), torch.rand(4, 5))),
    "LinearCrossEntropyLoss": (None, None),  # filled below when torch has it
}
PAIR_LOSSES = ["BCEWithLogitsLoss", "HuberLoss", "L1Loss", "MSELoss", "SmoothL1Loss", "SoftMarginLoss"]
ACTIVATIONS = ["CELU", "ELU", "GELU", "Hardshrink", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU",
               "LogSigmoid", "Mish", "RReLU", "ReLU", "ReLU6", "SELU", "SiLU", "Sigmoid", "Softplus", "Softshrink",
               "Softsign", "Tanh", "Tanhshrink"]
PADS = {f"{kind}Pad{d}d": d for kind in ("Circular", "Constant", "Reflection", "Replication", "Zero")
        for d in (1, 2, 3)}
NOT_MODULES = {"Module": "abstract base", "Container": "deprecated base", "RNNBase": "abstract base",
               "RNNCellBase": "abstract base", "DataParallel": "a wrapper, not a layer (docs/distributed.md)",
               "ModuleDict": "container without forward", "ModuleList": "container without forward",
               "ParameterDict": "container without forward", "ParameterList": "container without forward"}

for _name in PAIR_LOSSES:
    SPECS[_name] = (getattr(nn, _name), lambda: (r(4, 5), torch.rand(4, 5)))
for _name in ACTIVATIONS:
    SPECS[_name] = (getattr(nn, _name), _act())
for _name, _d in PADS.items():
    _args = (1, 0.5) if _name.startswith("Constant") else (1,)
    SPECS[_name] = (_lazy(getattr(nn, _name), *_args), {1: C1, 2: C2, 3: C3}[_d])
if hasattr(nn, "LinearCrossEntropyLoss"):
    try:
        nn.LinearCrossEntropyLoss(6, 5)
        SPECS["LinearCrossEntropyLoss"] = (_lazy(nn.LinearCrossEntropyLoss, 6, 5), lambda: (r(4, 6), ids(4)))
    except TypeError:
        del SPECS["LinearCrossEntropyLoss"]
else:
    del SPECS["LinearCrossEntropyLoss"]


def zoo_classes():
    return sorted(n for n in dir(nn) if isinstance(getattr(nn, n), type) and issubclass(getattr(nn, n), nn.Module)
                  and not n.startswith("_") and n not in NOT_MODULES)
