"""fp8 op lists against torchao's float8 training and bf16: loss after N steps and step time, on a small
decoder-style transformer (all matmul dims multiples of 16, so every linear runs in float8).

Variants (same seed, same batches):
  fp32                  no amp_patch
  bf16 O1 [torch_cpu]   amp_patch O1, native CPU autocast's list (linear in bf16)
  fp8 O1 [LIST]         amp_patch O1, fp8_linear_<device>[_rowwise] (F.linear in float8)
  torchao RECIPE        torchao.float8.convert_to_float8_training under native torch.autocast(bfloat16)

Run: PYTHONPATH=. python benchmarks/bench_fp8.py [--steps 30] [--device cpu|cuda] [--rounds 3]
Step times: median of the timed steps (after 3 warm-up steps), per round; rounds interleave the variants (a busy
moment of the machine hits all of them). On the CPU float8 is a reference kernel: expect fp8 slower than bf16.
"""
import argparse
import contextlib
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import amp_patch

DIM, HEADS, LAYERS, SEQ, VOCAB, BATCH = 64, 4, 2, 32, 64, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(self.ln(self.blocks(self.embed(tokens))))


def batches(steps, device):
    g = torch.Generator().manual_seed(0)
    # a learnable sequence task: the next token is (token * 5 + 3) mod VOCAB
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        seq = [start]
        for _ in range(SEQ):
            seq.append((seq[-1] * 5 + 3) % VOCAB)
        seq = torch.cat(seq, dim=1).to(device)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _loss(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def run(variant, base, data, device):
    """(losses, step seconds) of one variant."""
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    native = variant.startswith("torchao")
    if native:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(variant.split()[1]))
    elif variant != "fp32":
        model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0,
                                          op_lists=variant.split("[")[1].rstrip("]"))
    losses, times = [], []
    try:
        for tokens, target in data:
            start = time.perf_counter()
            opt.zero_grad()
            # not autocast(enabled=False) for amp_patch's rows: that region turns amp_patch's casting off too
            with torch.autocast(device, dtype=torch.bfloat16) if native else contextlib.nullcontext():
                logits = model(tokens)
            loss = _loss(logits, target)
            loss.backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    finally:
        if not native and variant != "fp32":
            amp_patch.deinitialize()
    return losses, times[3:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base, data = TinyLM(), batches(args.steps, args.device)
    suffix = args.device
    variants = ["fp32", f"bf16 O1 [torch_{suffix}]", f"fp8 O1 [fp8_linear_{suffix}]", "torchao tensorwise",
                f"fp8 O1 [fp8_linear_{suffix}_rowwise]", "torchao rowwise"]
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - torchao is a test-only dependency
        print(f"torchao not importable ({exc}); its rows are left out")
        variants = [v for v in variants if not v.startswith("torchao")]
    results = {v: ([], []) for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            losses, times = run(variant, base, data, args.device)
            results[variant][0].append(losses)
            results[variant][1].append(statistics.median(times))
    fp32 = results["fp32"][0][0]
    print(f"{args.steps} steps, batch {BATCH}x{SEQ} tokens, {LAYERS} layers of dim {DIM}, {args.device}, "
          f"{args.threads} thread(s), {args.rounds} rounds")
    print("| variant | final loss | max |loss - fp32| | max |loss - torchao same recipe| | step ms (median of "
          "rounds, min-max) |")
    print("|---|---|---|---|---|")
    for variant, (runs, medians) in results.items():
        losses = runs[0]
        recipe = "rowwise" if "rowwise" in variant else "tensorwise"
        ao = results.get(f"torchao {recipe}")
        vs_ao = max(abs(a - b) for a, b in zip(losses, ao[0][0])) if ao and variant.startswith("fp8") else None
        ms = [m * 1e3 for m in medians]
        print(f"| {variant} | {losses[-1]:.4f} | {max(abs(a - b) for a, b in zip(losses, fp32)):.4f} | "
              f"{'-' if vs_ao is None else f'{vs_ao:.2e}'} | {statistics.median(ms):.1f} ({min(ms):.1f}-"
              f"{max(ms):.1f}) |")


if __name__ == "__main__":
    main()
