"""An in-place edit of an O2 compute copy during its call (``nn.Embedding``'s ``max_norm``, a hook clamping weights)
is the model's edit of its weight: written back into the fp32 param when the call ends."""
import torch


def renorms(module):
    """Under dynamo (no version counters): the one torch module that edits its weight in place in its forward,
    an embedding with ``max_norm``, is written back by value."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None


def write_back(param, copy):
    """An in-place edit of a compute copy during the call is the model's edit of its weight: the fp32 param takes
    the edited values where the copy no longer holds the param's own rounding; the others stay exact."""
    with torch.inference_mode(False), torch.no_grad():
        edited = copy.ne(param.to(copy.dtype))
        param.copy_(torch.where(edited, copy.to(param.dtype), param))
