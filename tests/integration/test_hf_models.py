"""Beyond BERT: tiny randomly initialised Hugging Face GPT-2, T5 and ViT (built from a config, no download) train
30 steps under O1 fp16, O2 fp16 and O1 bf16; the final loss stays within a stated tolerance of fp32's.

The zoo (tests/zoo.py: GPT-2, BERT, T5, Llama, ViT, Whisper with eager and SDPA attention and their own gradient
checkpointing, torch's Transformer layers with and without torch.utils.checkpoint, a ResNet, an LSTM seq2seq) runs
under amp_patch and under the reference making the same casts (native autocast for O1, a hand-made O2, the half
model for O3): bitwise in eager mode, within COMPILE_TOLERANCE under torch.compile. The default suite runs the
reduced zoo (zoo.QUICK, zoo.QUICK_COMPILED); ``pytest -m stress`` the full matrix."""
import pytest
import torch

import amp_patch

transformers = pytest.importorskip("transformers")

STEPS = 30
#: |final loss - fp32 final loss| / fp32 final loss; bf16 has 8 mantissa bits against fp16's 11
TOLERANCE = {"O1 fp16": 0.05, "O2 fp16": 0.05, "O1 bf16": 0.10}
VARIANTS = {"O1 fp16": ("O1", torch.float16), "O2 fp16": ("O2", torch.float16), "O1 bf16": ("O1", torch.bfloat16)}


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as the released model

    def batch(g):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        return {"input_ids": ids, "labels": ids}
    return model, batch


def _t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)

    def batch(g):
        return {"input_ids": torch.randint(0, 64, (4, 10), generator=g),
                "labels": torch.randint(0, 64, (4, 6), generator=g)}
    return model, batch


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5)
    model = transformers.ViTForImageClassification(cfg)

    def batch(g):
        return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (4,), generator=g)}
    return model, batch


MODELS = {"gpt2": _gpt2, "t5": _t5, "vit": _vit}
LR = {"gpt2": 1e-2, "t5": 3e-3, "vit": 1e-3}


def _train(name, variant):
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR[name])
    if variant is not None:
        level, half = VARIANTS[variant]
        model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(4)]  # a few fixed batches: the loss must fall, not just wander
    losses = []
    try:
        for step in range(STEPS):
            loss = model(**data[step % len(data)]).loss.float()
            if variant is None:
                loss.backward()
            else:
                with amp_patch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        amp_patch.deinitialize()
    return losses


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_hf_model_trains_like_fp32(name):
    reference = _train(name, None)
    final_ref = sum(reference[-4:]) / 4  # the final loss: the mean over the last pass through the 4 batches
    assert final_ref < 0.9 * sum(reference[:4]) / 4  # fp32 learns the fixed batches
    for variant, tol in TOLERANCE.items():
        losses = _train(name, variant)
        final = sum(losses[-4:]) / 4
        rel = abs(final - final_ref) / final_ref
        print(f"{name} {variant}: final loss {final:.4f} vs fp32 {final_ref:.4f} (rel {rel:.4f})")
        assert all(torch.isfinite(torch.tensor(losses))), (variant, losses)
        assert rel <= tol, (variant, final, final_ref)


# --- the zoo (tests/zoo.py): every architecture against the reference making the same casts -----------------------

import zoo  # noqa: E402

#: under torch.compile (aot_eager: dynamo and AOTAutograd) the graph may reorder or fuse decompositions: the runs
#: agree within this (absolute, on the losses and the weights after 3 SGD-momentum steps at lr 1e-2)
COMPILE_TOLERANCE = 2e-2


def _check(name, variant, compile=False, steps=3):
    ours, ref, diff = zoo.agree(name, variant, steps, compile=compile)
    if diff is None:  # native autocast cannot run it (oneDNN has no half LSTM here): nothing to compare
        return
    limit = COMPILE_TOLERANCE if compile else zoo.KNOWN_GAPS.get((name, variant), 0.0)
    assert diff <= limit, (name, variant, diff, ours if ours[0] == "raised" else ours[0],
                           ref if ref[0] == "raised" else ref[0])


@pytest.mark.parametrize("name,variant", zoo.QUICK, ids=[f"{n}-{v}" for n, v in zoo.QUICK])
def test_zoo_matches_the_reference_bitwise(name, variant):
    _check(name, variant, steps=zoo.QUICK_STEPS)


@pytest.mark.parametrize("name,variant", zoo.QUICK_COMPILED, ids=[f"{n}-{v}" for n, v in zoo.QUICK_COMPILED])
def test_zoo_compiled_within_tolerance(name, variant):
    _check(name, variant, compile=True, steps=1)


FULL = [(n, v) for n in zoo.ZOO for v in zoo.VARIANTS]


@pytest.mark.stress
@pytest.mark.parametrize("name,variant", FULL, ids=[f"{n}-{v}" for n, v in FULL])
def test_full_zoo_matches_the_reference_bitwise(name, variant):
    _check(name, variant)


@pytest.mark.stress
@pytest.mark.parametrize("name,variant", FULL, ids=[f"{n}-{v}" for n, v in FULL])
def test_full_zoo_compiled_within_tolerance(name, variant):
    _check(name, variant, compile=True)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ctrl_c_inside_a_checkpointed_gpt2_block_leaves_nothing_behind(level):
    """A tiny GPT-2 with gradient checkpointing, Ctrl-C inside its second block mid training step (a pre-hook that
    raises ``KeyboardInterrupt``), then an eval under ``torch.inference_mode()`` as an interrupt handler would run:
    the logits are those of the same eval before the interrupt (O1: also native autocast's on an fp32 copy, bitwise),
    the checkpoint holds fp32 params, and native autocast is off after the block and after deinitialize (before
    the guard on the model's forward, the stale region came back on for good when the block ended)."""
    import copy

    torch.manual_seed(0)
    model, batch = _gpt2()
    model.gradient_checkpointing_enable()
    reference = copy.deepcopy(model).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    ids = batch(torch.Generator().manual_seed(1))["input_ids"]

    def evaluate():
        model.eval()
        with torch.inference_mode():
            logits = model(ids).logits.clone()
        model.train()
        return logits

    before = evaluate()

    def ctrl_c(module, args):
        raise KeyboardInterrupt

    handle = model.transformer.h[1].register_forward_pre_hook(ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    after = evaluate()
    assert not torch._C.is_autocast_enabled("cpu")
    assert torch.equal(after, before)
    assert all(v.dtype is torch.float32 for v in model.state_dict().values() if v.is_floating_point())
    if level == "O1":
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(after, reference(ids).logits)
    amp_patch.deinitialize()
    assert not torch._C.is_autocast_enabled("cpu")
