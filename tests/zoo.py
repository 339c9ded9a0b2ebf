"""A zoo of real architectures as a test generator: tiny models people train, each run under amp_patch and under
the reference that makes the same casts.

Public API (other tests reuse it):

* ``ZOO``: ``{name: builder}``; ``builder()`` returns a :class:`Case` ``(model, make_batch, loss_fn, lr)``:
  ``make_batch(generator)`` gives one batch (a dict of keyword arguments, a tuple of positional ones, or one
  tensor), ``loss_fn(output, batch)`` the scalar loss. Everything is built on the CPU from configs (no download),
  hidden size 32, 2 layers, batch 2-4, short sequences. ``QUICK``: the names of the reduced zoo.
* ``VARIANTS``: ``{name: (opt_level, half dtype)}``: O1/O2/O3 in bf16 (no scaling) and fp16 (dynamic scaling).
* ``train(name, variant, steps=3, compile=False)``: the losses and final fp32 weights of ``steps`` SGD-momentum
  steps under amp_patch; ``reference(name, variant, steps=3, compile=False)``: the same from the reference:
  native ``torch.autocast`` for O1 (with non-reentrant checkpointing where the model's is reentrant:
  :data:`O1_REFERENCE_MODE`); for O2 a hand-made O2 (buffers cast once, each param outside batchnorm cast
  once per step, ``p.to(half)``, the copies in the module for the forward and the backward, so a checkpointed
  segment recomputes with the same copies; inputs cast to half, outputs to fp32); for O3 the half model.
  Both scale the loss the same way (fp16: dynamic from 2**16, an overflow halves it and skips the step).
* ``compare(a, b)``: the largest absolute difference of two runs' losses and weights (0.0: bitwise).
"""
import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import amp_patch

VARIANTS = {"O1-bf16": ("O1", torch.bfloat16), "O1-fp16": ("O1", torch.float16),
            "O2-bf16": ("O2", torch.bfloat16), "O2-fp16": ("O2", torch.float16),
            "O3-bf16": ("O3", torch.bfloat16), "O3-fp16": ("O3", torch.float16)}
INIT_SCALE = 2.0 ** 16
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Case:
    model: nn.Module
    make_batch: object
    loss_fn: object
    lr: float = 1e-2


def _hf_loss(out, batch):
    return out.loss


# --- transformers models (built from configs, no download) ---------------------------------------------------------

def _tf():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def _lm_batch(vocab, batch=2, seq=8, labels=True):
    def make(g):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}
    return make


def _hf(model, attn, checkpointing):
    if checkpointing:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def gpt2(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_implementation=attn,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return Case(_hf(t.GPT2LMHeadModel(cfg), attn, checkpointing), _lm_batch(64), _hf_loss)


def bert(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=16, attn_implementation=attn,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _hf(t.BertForMaskedLM(cfg), attn, checkpointing)
    return Case(model, _lm_batch(64), _hf_loss)


def t5(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                     decoder_start_token_id=0, attn_implementation=attn)
    model = _hf(t.T5ForConditionalGeneration(cfg), attn, checkpointing)

    def make(g):
        return {"input_ids": torch.randint(0, 64, (2, 8), generator=g),
                "labels": torch.randint(0, 64, (2, 5), generator=g)}
    return Case(model, make, _hf_loss)


def llama(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        attn_implementation=attn)
    return Case(_hf(t.LlamaForCausalLM(cfg), attn, checkpointing), _lm_batch(64), _hf_loss)


def vit(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, num_labels=5, attn_implementation=attn,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _hf(t.ViTForImageClassification(cfg), attn, checkpointing)

    def make(g):
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (2,), generator=g)}
    return Case(model, make, _hf_loss)


def whisper(attn="eager", checkpointing=None):
    t = _tf()
    cfg = t.WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, dropout=0.0,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                          attn_implementation=attn)
    model = _hf(t.WhisperForConditionalGeneration(cfg), attn, checkpointing)

    def make(g):
        return {"input_features": torch.randn(2, 8, 16, generator=g),
                "labels": torch.randint(3, 64, (2, 5), generator=g)}
    return Case(model, make, _hf_loss)


# --- torch.nn layers, a ResNet, an LSTM seq2seq --------------------------------------------------------------------

class EncoderStack(nn.Module):
    """Embedding, 2 ``nn.TransformerEncoderLayer`` (each optionally under ``torch.utils.checkpoint``), a head."""

    def __init__(self, checkpointing=None, norm_first=False):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True,
                                                               norm_first=norm_first) for _ in range(2))
        self.head = nn.Linear(32, 64)
        self.checkpointing = checkpointing

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            if self.checkpointing:
                h = ckpt.checkpoint(layer, h, use_reentrant=self.checkpointing == "reentrant")
            else:
                h = layer(h)
        return self.head(h)


class Seq2SeqTransformer(nn.Module):
    """``nn.Transformer`` (2+2 layers) between embeddings and a head, with a causal target mask."""

    def __init__(self):
        super().__init__()
        self.src, self.tgt = nn.Embedding(64, 32), nn.Embedding(64, 32)
        self.core = nn.Transformer(32, 2, 2, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 64)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.core(self.src(src), self.tgt(tgt), tgt_mask=mask))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A ResNet written out: stem, two basic blocks (one downsampling), global pool, a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.fc = nn.Linear(16, 5)

    def forward(self, x, labels=None):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class LSTMSeq2Seq(nn.Module):
    """An LSTM encoder and an LSTM decoder fed the encoder's final state (teacher forcing), a head."""

    def __init__(self):
        super().__init__()
        self.src, self.tgt = nn.Embedding(64, 32), nn.Embedding(64, 32)
        self.encoder = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.decoder = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 64)

    def forward(self, src, tgt):
        _, state = self.encoder(self.src(src))
        out, _ = self.decoder(self.tgt(tgt), state)
        return self.head(out)


def _ce(out, batch):
    target = batch[-1] if isinstance(batch, tuple) else batch
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten())


def encoder_stack(checkpointing=None, norm_first=False):
    return Case(EncoderStack(checkpointing, norm_first).train(),
                lambda g: torch.randint(0, 64, (2, 8), generator=g), _ce)


def seq2seq_transformer():
    return Case(Seq2SeqTransformer().train(),
                lambda g: (torch.randint(0, 64, (2, 7), generator=g), torch.randint(0, 64, (2, 5), generator=g)), _ce)


def resnet():
    def make(g):
        return {"x": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}
    return Case(ResNet().train(), make, lambda out, batch: F.cross_entropy(out.float(), batch["labels"]))


def lstm_seq2seq():
    return Case(LSTMSeq2Seq().train(),
                lambda g: (torch.randint(0, 64, (2, 7), generator=g), torch.randint(0, 64, (2, 5), generator=g)), _ce)


def _named(fn, **kw):
    return lambda: fn(**kw)


ZOO = {}
for _attn in ("eager", "sdpa"):  # (this transformers' T5 has no SDPA attention: eager only)
    for _name, _fn in (("gpt2", gpt2), ("bert", bert), ("t5", t5), ("llama", llama), ("vit", vit),
                       ("whisper", whisper)):
        if not (_name == "t5" and _attn == "sdpa"):
            ZOO[f"{_name}-{_attn}"] = _named(_fn, attn=_attn)
for _name, _fn in (("gpt2", gpt2), ("bert", bert), ("llama", llama), ("t5", t5)):
    for _mode in ("reentrant", "nonreentrant"):
        ZOO[f"{_name}-ckpt-{_mode}"] = _named(_fn, attn="eager" if _name == "t5" else "sdpa", checkpointing=_mode)
ZOO["encoder"] = _named(encoder_stack)
ZOO["encoder-norm-first"] = _named(encoder_stack, norm_first=True)
ZOO["encoder-ckpt-reentrant"] = _named(encoder_stack, checkpointing="reentrant")
ZOO["encoder-ckpt-nonreentrant"] = _named(encoder_stack, checkpointing="nonreentrant")
ZOO["transformer"] = seq2seq_transformer
ZOO["resnet"] = resnet
ZOO["lstm-seq2seq"] = lstm_seq2seq

#: the reduced zoo of the default suite (2 steps): each family under O2-bf16 (HF checkpointing reentrant and
#: not, torch checkpointing reentrant and not), and the other variants spread over the cheap models
QUICK_STEPS = 2
QUICK = [(name, "O2-bf16") for name in (
    "gpt2-ckpt-nonreentrant", "bert-eager", "t5-eager", "llama-ckpt-reentrant", "vit-sdpa",
    "encoder-ckpt-nonreentrant", "encoder-ckpt-reentrant", "transformer", "resnet", "lstm-seq2seq")] + [
    ("bert-eager", "O1-fp16"), ("resnet", "O1-bf16"), ("transformer", "O3-fp16"),
    ("encoder-ckpt-nonreentrant", "O2-fp16"), ("lstm-seq2seq", "O3-bf16")]
#: pairs not bitwise in eager mode, with the bound they hold and why (an open finding, not a tolerance to widen)
KNOWN_GAPS = {}
#: O1 with reentrant checkpointing is compared with native autocast running the same model with non-reentrant
#: checkpointing: native's two modes disagree with each other on HF BERT and T5 (the encoder's grads one half ulp
#: apart; after 3 momentum steps 2e-7 / 2e-6 in BERT's losses and weights, bf16 / fp16, and 3e-3 / 1e-4 in T5's),
#: while fp32 runs of the two modes agree, GPT-2 and Llama agree in both, and amp_patch's O1 gives native's
#: non-reentrant bits in both modes (measured 2026-12-03, torch 2.13; the reentrant reference was BERT's open
#: finding, KNOWN_GAPS, and failed T5 in the full zoo)
O1_REFERENCE_MODE = {"reentrant": "nonreentrant"}
#: compiled in the default suite (1 step: the compile dominates)
QUICK_COMPILED = [("encoder", "O2-bf16"), ("encoder-norm-first", "O1-bf16")]


# --- running -------------------------------------------------------------------------------------------------------

def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def _build(name, seed=0):
    torch.manual_seed(seed)
    return ZOO[name]()


def _batches(case, steps):
    g = torch.Generator().manual_seed(1)
    return [case.make_batch(g) for _ in range(steps)]


def _weights(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _maybe_compile(model, compile):
    """``compile``: False, True (the ``aot_eager`` backend: dynamo and AOTAutograd, no C++ build) or a backend."""
    if not compile:
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager" if compile is True else compile)


def train(name, variant, steps=3, compile=False):
    """``steps`` steps of ``name`` under amp_patch ``variant``: ``(losses, fp32 state_dict values)``."""
    level, half = VARIANTS[variant]
    case = _build(name)
    opt = torch.optim.SGD(case.model.parameters(), lr=case.lr, momentum=0.9)
    scale = "dynamic" if half is torch.float16 else None
    model, opt = amp_patch.initialize(case.model, opt, opt_level=level, half_dtype=half, verbosity=0,
                                      **({"loss_scale": scale} if scale else {}))
    run = _maybe_compile(model, compile)
    losses = []
    try:
        for batch in _batches(case, steps):
            loss = case.loss_fn(_call(run, batch), batch).float()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, _weights(model)
    finally:
        amp_patch.deinitialize()


def reference(name, variant, steps=3, compile=False):
    """The same steps under the reference of ``variant`` (see the module docstring)."""
    level, half = VARIANTS[variant]
    case = _build(name)
    model = case.model
    if level == "O3":
        model.to(half)
    elif level == "O2":
        _cast_buffers(model, half)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=0.9)
    run = _maybe_compile(model, compile)
    scale = INIT_SCALE if half is torch.float16 else 1.0
    losses = []
    for batch in _batches(case, steps):
        with _step_casts(model, level, half):
            out = _call(run, _cast_inputs(batch, half) if level != "O1" else batch)
            if level != "O1":
                out = _tree(out, lambda t: t.float())
            loss = case.loss_fn(out, batch).float()
            (loss * scale).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            torch._foreach_mul_(grads, 1.0 / scale)
            opt.step()
        elif half is torch.float16:
            scale *= 0.5
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _weights(model)


@contextlib.contextmanager
def _step_casts(model, level, half):
    if level == "O1":
        with torch.autocast("cpu", dtype=half):
            yield
        return
    if level == "O3":
        yield
        return
    swapped, copies = [], {}
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.dtype in FLOATS:
                copy_ = copies.setdefault(id(p), p.to(half))
                module._parameters[name] = copy_
                swapped.append((module, name, p))
    _refresh(model)
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
        _refresh(model)


def _refresh(model):
    for m in model.modules():
        if isinstance(m, nn.RNNBase):
            m._init_flat_weights()


def _cast_buffers(model, half):
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for b in module._buffers.values():
            if b is not None and b.is_floating_point() and b.dtype is not torch.float64:
                b.data = b.data.to(half)


def _tree(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() and obj.dtype is not torch.float64 else obj
    if isinstance(obj, dict):
        return type(obj)({k: _tree(v, fn) for k, v in obj.items()}) if not hasattr(obj, "to_tuple") else \
            _model_output(obj, fn)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_tree(v, fn) for v in obj)
    return obj


def _model_output(obj, fn):
    out = copy.copy(obj)
    for k, v in obj.items():
        out[k] = _tree(v, fn)
    return out


def _cast_inputs(batch, half):
    return _tree(batch, lambda t: t.to(half))


def compare(a, b):
    """The largest absolute difference between two runs' losses and final weights (0.0: bitwise)."""
    (la, wa), (lb, wb) = a, b
    assert wa.keys() == wb.keys(), sorted(set(wa) ^ set(wb))
    diffs = [abs(x - y) for x, y in zip(la, lb)]
    for k in wa:
        d = (wa[k] - wb[k]).abs()
        diffs.append(float(d.max()) if d.numel() else 0.0)
    return max(diffs)


def outcome(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``'s result, or ``("raised", exception type name)``: native autocast fails on some
    pairs too (oneDNN has no half LSTM primitive on some CPUs), and then amp_patch must fail the same way."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        return ("raised", type(exc).__name__, str(exc).split(".")[0])


def _reference_name(name, variant):
    """The zoo model the reference runs for ``name`` (see :data:`O1_REFERENCE_MODE`)."""
    if VARIANTS[variant][0] != "O1":
        return name
    for mode, instead in O1_REFERENCE_MODE.items():
        if name.endswith(f"-ckpt-{mode}"):
            return name[: -len(mode)] + instead
    return name


def agree(name, variant, steps=3, compile=False):
    """``(ours, reference, largest difference)``; the difference is None when the reference raised (native
    autocast cannot run the pair: nothing to compare; amp_patch may raise the same error or run it) and ``inf``
    when only amp_patch raised."""
    ours = outcome(train, name, variant, steps, compile)
    ref = outcome(reference, _reference_name(name, variant), variant, steps, compile)
    if ref[0] == "raised":
        return ours, ref, (None if ours[0] != "raised" or ours == ref else float("inf"))
    if ours[0] == "raised":
        return ours, ref, float("inf")
    return ours, ref, compare(ours, ref)
