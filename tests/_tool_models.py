"""Tiny real architectures for the tools' tests: builders returning ``(model, make_batch, loss)``, so that they can
join a shared model zoo later, and ``*_job`` functions adapting them to the experiment's job convention
(``model_fn``/``optimizer_fn``/``data_fn``/``loss_fn``; importable, so spawned variant processes can load them).

- ``gpt2``: ``transformers`` GPT-2 (eager attention) from a config, no download. Its eager attention masks the
  future with ``finfo.min`` and adds the padding mask (``finfo.min`` too): in float32, a padded future position
  holds ``finfo.min + finfo.min = -inf``, an intended non-finite value.
- ``bert``: ``transformers`` BERT (eager attention) for sequence classification, a padding mask.
- ``masked``: a hand-written causal attention that masks with ``masked_fill(mask, -inf)``.

``hot=True`` scales the query and key projections so that q·kᵀ leaves float16's range (about 2e5) while float32
holds it and trains: the overflow the doctor must find behind the intended ``-inf``.
"""
import os

import torch
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB, SEQ, EMBD, HEADS, CLASSES, N = 64, 8, 32, 2, 4, 32
_HOT = 2000.0  # q and k ~ 200: their dot over a 16-wide head ~ 2e5 > float16's 65504


def _tokens(seed, n=N):
    """Token ids, a right-padding mask (every row keeps at least 3 tokens) and next-token labels (-100 at pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), torch.roll(ids, -1, dims=1), torch.full_like(ids, -100))
    return ids, mask, labels


def _lm_loss(output, labels):
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _class_loss(output, target):
    return F.cross_entropy(getattr(output, "logits", output).float(), target)


def _heat(*linears):
    with torch.no_grad():
        for layer in linears:
            layer.mul_(_HOT)


class CausalLM(nn.Module):
    """A Hugging Face causal LM called as ``model(ids, mask)`` (GPT-2's second positional argument is the cache)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, mask):
        return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits


def gpt2(hot=False, layers=2, embd=EMBD):
    """A 2-layer GPT-2 (eager attention), its batches (ids, padding mask, labels) and its next-token loss.
    ``embd``: its width (``n_embd``; 36 makes every projection's size a non-multiple of 8)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=embd, n_layer=layers, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    model = CausalLM(GPT2LMHeadModel(config))
    if hot:
        for block in model.lm.transformer.h:
            _heat(block.attn.c_attn.weight[:, :2 * EMBD])  # Conv1D: (in, 3 * embd), q and k first
    return model, _tokens, _lm_loss


def bert(hot=False, layers=2):
    """A 2-layer BERT classifier (eager attention), its batches (ids, padding mask, class) and its loss."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=EMBD, num_hidden_layers=layers, num_attention_heads=HEADS,
                        intermediate_size=2 * EMBD, max_position_embeddings=SEQ * 2, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    model = BertForSequenceClassification(config)
    if hot:
        for layer in model.bert.encoder.layer:
            _heat(layer.attention.self.query.weight, layer.attention.self.key.weight)

    def batch(seed, n=N):
        ids, mask, _ = _tokens(seed, n)
        return ids, mask, ids[:, 0] % CLASSES  # the class is read off the first token
    return model, batch, _class_loss


class MaskedAttention(nn.Module):
    """Causal single-head attention masked with ``masked_fill(mask, -inf)``, a residual and a classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBD)
        self.q, self.k, self.v = nn.Linear(EMBD, 16), nn.Linear(EMBD, 16), nn.Linear(EMBD, EMBD)
        self.head = nn.Linear(EMBD, VOCAB)
        self.register_buffer("future", torch.ones(SEQ, SEQ).triu(1).bool(), persistent=False)

    def forward(self, ids, mask):
        h = self.embed(ids)
        scores = torch.matmul(self.q(h), self.k(h).transpose(1, 2)) / 4.0
        scores = scores.masked_fill(self.future | ~mask.bool()[:, None, :], float("-inf"))
        return self.head(h + torch.matmul(torch.softmax(scores, dim=-1), self.v(h)))


def masked(hot=False):
    model = MaskedAttention()
    if hot:
        _heat(model.q.weight, model.k.weight)
    return model, _tokens, _lm_loss


# -- the experiment's job convention ------------------------------------------------------------------------------

def _job(builder, name, hot, lr=0.05, batch_size=8):
    return {"model_fn": _MODEL_FNS[(builder.__name__, hot)], "optimizer_fn": _sgd if lr == 0.05 else _sgd_small,
            "data_fn": _DATA_FNS[builder.__name__], "loss_fn": _class_loss if builder is bert else _lm_loss,
            "batch_size": batch_size, "name": name}


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def _sgd_small(model):
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def gpt2_model():
    return gpt2()[0]


def gpt2_hot_model():
    return gpt2(hot=True)[0]


def bert_model():
    return bert()[0]


def bert_hot_model():
    return bert(hot=True)[0]


def masked_model():
    return masked()[0]


def masked_hot_model():
    return masked(hot=True)[0]


def lm_data():
    return _tokens(0)


def bert_data():
    return bert()[1](0)


_MODEL_FNS = {("gpt2", False): gpt2_model, ("gpt2", True): gpt2_hot_model, ("bert", False): bert_model,
              ("bert", True): bert_hot_model, ("masked", False): masked_model, ("masked", True): masked_hot_model}
_DATA_FNS = {"gpt2": lm_data, "masked": lm_data, "bert": bert_data}


def gpt2_job():
    return _job(gpt2, "gpt2", False)


def gpt2_hot_job():
    return _job(gpt2, "gpt2_hot", True)


def bert_hot_job():
    return _job(bert, "bert_hot", True)


def masked_hot_job():
    return _job(masked, "masked_hot", True)


def gpt2_small_lr_job():
    """GPT-2 trained with a small learning rate: under O3 (half weights), many updates fall below the weights'
    resolution and are lost."""
    return _job(gpt2, "gpt2_small_lr", False, lr=1e-3)


def masked_job():
    return _job(masked, "masked", False)


def gpt2_odd_model():
    return gpt2(embd=36)[0]


def gpt2_odd_job():
    """GPT-2 with n_embd=36: its projections (Conv1D: addmm inside transformers) have sizes 36, 108, 144."""
    return dict(_job(gpt2, "gpt2_odd", False), model_fn=gpt2_odd_model)
