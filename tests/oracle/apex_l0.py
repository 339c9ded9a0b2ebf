"""Apex's own tests (NVIDIA/apex at e13873de: ``tests/L0`` and ``tests/distributed/synced_batchnorm``) on CPU
against amp_patch's mirror of Apex's modules.

Apex is located by ``AMP_PATCH_APEX_SRC`` (a checkout's root, as for :mod:`apex_real`); without it the tests
skip. Nothing of Apex is copied or imported here: :func:`run_files` starts child processes
(``_apex_l0_child.py``) in which ``import apex`` is amp_patch's mirror (the apex alias) and Apex's test files
are loaded from the checkout with the CUDA-only spellings made CPU ones:

* :data:`CPU_PORT`, a source substitution applied to every loaded test module: ``torch.cuda.<T>Tensor`` types
  and type strings become CPU ones, ``.cuda()`` / ``device='cuda'`` / ``.to('cuda')`` become CPU,
  ``torch.amp.autocast('cuda')`` / ``GradScaler('cuda')`` become the CPU ones (autocast keeping CUDA's
  default fp16), the device-type tests are instantiated for CPU, and ``nccl`` process groups become ``gloo``;
* :data:`FILE_PORT`, the few per-file substitutions (each with its reason);
* :data:`CPU_PATCHES`, monkeypatches in the child: ``torch.cuda.synchronize`` / ``set_device`` do nothing,
  ``torch.cuda.manual_seed`` seeds the CPU generator (the ported ``device='cuda'`` draws are CPU draws),
  ``torch.cuda.is_bf16_supported()`` is True (CPU has bf16);
  ``torch.cuda.device_count()`` stays 0, so Apex's own multi-GPU ``skipIf`` decorators skip;
* :data:`SHRINK`, size substitutions for the CI profile only (fp16 CPU kernels are slow), which also leaves
  out :data:`LONG_ONLY`; the ``long`` profile (``AMP_PATCH_APEX_L0=long``) runs Apex's sizes and every file;
* :data:`PORTED_AWAY`: tests that cannot mean on CPU what they mean on CUDA, skipped with the reason and
  counted apart ("ported"), never as passes;
* :data:`KNOWN_FAILURES`: tests that fail for a reason that is not the mirror's (Apex's own kernel gives the
  same result, the test's expectation contradicts it): run, and counted as "known" while they fail with the
  listed message; one that passes or fails otherwise is a failure.

Files whose module the mirror lacks are listed in :data:`NOT_MIRRORED`. The synced_batchnorm scripts check by
``compare(desc, a, b, error)``: each call is one check, plus one for the script running to its end (its own
asserts); the two-process ones run on gloo with two CPU ranks. A test needing onnx/onnxscript (the layer norms'
export tests) skips when they are not installed. ``python tests/oracle/apex_l0.py [FILTER]`` prints the counts.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

ENV = "AMP_PATCH_APEX_SRC"
PROFILE_ENV = "AMP_PATCH_APEX_L0"

CPU_PORT = (
    ("torch.cuda.FloatTensor", "torch.FloatTensor"), ("torch.cuda.HalfTensor", "torch.HalfTensor"),
    ("torch.cuda.DoubleTensor", "torch.DoubleTensor"), ("torch.cuda.IntTensor", "torch.IntTensor"),
    ("torch.cuda.BFloat16Tensor", "torch.BFloat16Tensor"),
    (".cuda()", ".cpu()"), ("device='cuda'", "device='cpu'"), ('device="cuda"', 'device="cpu"'),
    (".to('cuda')", ".to('cpu')"),
    # CUDA autocast's default dtype is fp16 (CPU's: bf16)
    ("torch.amp.autocast('cuda', enabled=True)", "torch.amp.autocast('cpu', dtype=torch.float16, enabled=True)"),
    ("torch.amp.autocast('cuda'", "torch.amp.autocast('cpu'"),
    ("torch.amp.GradScaler('cuda'", "torch.amp.GradScaler('cpu'"),
    ('only_for=("cuda",)', 'only_for=("cpu",)'),
    ("backend='nccl'", "backend='gloo'"),
)

FILE_PORT = {
    "test_fused_layer_norm": (
        # "the CUDA module's output is on CUDA": on CPU, the ported module's output is on CPU
        ("self.assertTrue(out_cuda_.is_cuda)", "self.assertFalse(out_cuda_.is_cuda)"),
        # its draws are CPU ones, which torch.cuda.manual_seed leaves alone on CUDA: so it does here (the data
        # are then those of a CUDA run, from common_utils.TestCase's seed)
        ("torch.cuda.manual_seed(42)", "pass"),
    ),
    "test_checkpointing": (  # test_loss_scale_decrease draws its model's scale param unseeded: where |param| is
        # small, x * 2**17 * param no longer overflows fp16 and a back-off the test counts on does not happen
        # (flaky on CUDA too: about 1 run in 4 here); seeded with the file's own seed() as its other tests are
        ("nb_decrease_loss_scales_tmp = list(nb_decrease_loss_scales)",
         "nb_decrease_loss_scales_tmp = list(nb_decrease_loss_scales); self.seed()"),
    ),
    "two_gpu_test_different_batch_size": (  # each rank's device, its nccl group, DDP's device_ids: CPU, gloo, none
        ("torch.device('cuda:{}'.format(args.local_rank))", "torch.device('cpu')"), ("    'nccl',", "    'gloo',"),
        ("DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)", "DDP(model)"),
    ),
}

CPU_PATCHES = (
    "torch.cuda.synchronize: no-op", "torch.cuda.set_device: no-op",
    "torch.cuda.manual_seed: seeds the CPU generator (the ported draws are CPU ones)",
    "torch.cuda.manual_seed_all: no-op (torch.manual_seed calls it)",
    "torch.cuda.is_bf16_supported: True",
)

_SIZES = "sizes = [[4096, 1024], [4096], [4096, 2048], [32320, 1024], [1]]"  # 45M elements
_FUZZ = (("(7777*77, 555*555)", "(777*7, 555*5)"),
         ("((7, 77, 7, 77), (5, 55, 5, 55))", "((7, 7, 7, 77), (5, 5, 5, 55))"),
         ("(55, 47, 5, 55)", "(5, 47, 5, 55)"), ("(55, 47, 55, 5)", "(5, 47, 55, 5)"),
         ("            1,\n            55)", "            1,\n            5)"))
SHRINK = {
    # batch 65536 of [32, 16] fp32 rows: ~20 s a test on CPU; the CI profile normalises 512 rows
    "test_fused_layer_norm": (("(16, 65536)", "(16, 512)"),),
    "test_adam": (("for i in range(100):", "for i in range(10):"),),  # 10 of the 100 training steps
    "test_fused_optimizer": ((_SIZES, "sizes = [[64, 1024], [4096], [64, 2048], [323, 1024], [1]]"),),
    "test_lamb": ((_SIZES, "sizes = [[64, 1024], [4096], [64, 2048], [323, 1024], [1]]"),),
    "test_fused_novograd": ((_SIZES, "sizes = [[64, 1024], [4096], [64, 2048], [323, 1024], [1]]"),),
    # the fuzzers' largest pairs (up to 600k + 300k elements) shrunk, and 55 repeats of each pair: 5
    "test_multi_tensor_axpby": _FUZZ, "test_multi_tensor_scale": _FUZZ, "test_multi_tensor_l2norm": _FUZZ,
    "test_multi_tensor_unscale_l2norm": _FUZZ,
}

# "file stem::Class.method" (fnmatch pattern) -> why the test cannot mean on CPU what it means on CUDA
PORTED_AWAY = {
    "test_fused_layer_norm::TestFusedLayerNormCPU.test_autocast_fused_layer_norm_float16_*_memory_efficient_False_*": (
        "the reference is torch.nn.LayerNorm in fp16, whose CPU backward is not CUDA's fp32 one: 1758 of 8192 "
        "input grads are off the correctly rounded value (the mirror's, fp32 math rounded once as Apex's "
        "kernel: 8, double rounding), beyond the test's fp16 bound for near-zero grads; on CUDA the reference "
        "computes in fp32"),
}

# file id -> {test key -> (a fragment of the failure's message, the reason[, the profiles it holds in])}
KNOWN_FAILURES = {
    "L0/run_optimizers/test_fused_optimizer.py": {"test_fused_optimizer::test_fused_optimizer.TestFusedSGD.test_half": (
        "not less than or equal to 0.001",
        "Apex's kernel (csrc/multi_tensor_sgd_kernel.cu) updates an fp16 weight with the fp32 momentum and stores "
        "the momentum as fp16 afterwards; the mirror does the same, bit for bit; torch.optim.SGD rounds the "
        "momentum to fp16 before the update: after 7 steps they are up to 3 fp16 ulps apart (0.0029 at |p| in "
        "[1, 2)) where the test allows 0.001 (NVIDIA/apex#1143 reports the same divergence on CUDA)")},
    "L0/run_optimizers/test_fused_novograd.py": {
        "test_fused_novograd::test_fused_novograd.TestFusedNovoGrad.test_multi_params": (
            "not less than or equal to 1",
            "a relative error at a near-zero element, not a wrong update: the largest absolute difference over "
            "the 5 params (45M elements) is 2.4e-7 (2 fp32 ulps at 1.0; the test allows 1e-3); the relative bound "
            "fails where the reference param has cancelled to 8.5e-11 (the mirror's: -2.1e-9). The reference "
            "normalises the grad it shares with FusedNovoGrad in place, so the fused step renormalises a "
            "unit-norm grad; torch.rand on CPU draws other values than on CUDA (long profile: the CI one's smaller "
            "params pass)", ("long",))},
    "L0/run_amp/test_multi_tensor_unscale_l2norm.py": {
        "test_multi_tensor_unscale_l2norm::test_multi_tensor_unscale_l2norm.TestMultiTensorUnscaleL2Norm.test_fuzz": (
            "torch.Size([1]) != torch.Size([])",
            "Apex's kernel returns the total norm with shape [1] (csrc/multi_tensor_l2norm_kernel.cu, "
            "multi_tensor_unscale_l2norm_cuda: at::empty({1})), as the mirror does; the test compares it to a "
            "0-dim norm with assert_close, which checks shapes: it fails against Apex's kernel too")},
    "distributed/synced_batchnorm/two_gpu_unit_test.py --fp16": {
        "[rank 0] two_gpu_unit_test::comparing bn vs sbn bias": (
            "largest |a - b|",
            "a compare the script prints but leaves out of its verdict: Apex's reduce_bn returns each rank's "
            "grad_bias in the weight's dtype (csrc/welford.cu), which DDP then averages, as the stand-in does: "
            "per-rank sums near 150 rounded to fp16 (ulp 0.125) put the bias 6 fp16 ulps from single-process "
            "BatchNorm's, which rounds the whole sum once")},
    "distributed/synced_batchnorm/test_groups.py --group_size=2": {
        f"[rank {r}] test_groups::<script ran to its end>": (
            "batchnorm_backward() missing 1 required positional argument: 'count'",
            "the script calls syncbn.batchnorm_backward without the count argument that Apex's extension "
            "requires (csrc/syncbn.cpp: batchnorm_backward_CUDA(..., sum_dy_xmu, count)), as the stand-in does; "
            "the script stops there against Apex too") for r in (0, 1)},
}

# (folder under tests/, file stem, kind, extra argv, processes)
FILES = (
    ("L0/run_optimizers", "test_adam", "unittest", (), 1),
    ("L0/run_optimizers", "test_fused_optimizer", "unittest", (), 1),
    ("L0/run_optimizers", "test_fused_novograd", "unittest", (), 1),
    ("L0/run_optimizers", "test_lamb", "unittest", (), 1),
    ("L0/run_fused_layer_norm", "test_fused_layer_norm", "unittest", (), 1),
    ("L0/run_fp16util", "test_fp16util", "unittest", (), 1),
    ("L0/run_amp", "test_add_param_group", "unittest", (), 1),
    ("L0/run_amp", "test_basic_casts", "unittest", (), 1),
    ("L0/run_amp", "test_cache", "unittest", (), 1),
    ("L0/run_amp", "test_checkpointing", "unittest", (), 1),
    ("L0/run_amp", "test_fused_sgd", "unittest", (), 1),
    ("L0/run_amp", "test_larc", "unittest", (), 1),
    ("L0/run_amp", "test_multi_tensor_axpby", "unittest", (), 1),
    ("L0/run_amp", "test_multi_tensor_l2norm", "unittest", (), 1),
    ("L0/run_amp", "test_multi_tensor_scale", "unittest", (), 1),
    ("L0/run_amp", "test_multi_tensor_unscale_l2norm", "unittest", (), 1),
    ("L0/run_amp", "test_multiple_models_optimizers_losses", "unittest", (), 1),
    ("L0/run_amp", "test_promotion", "unittest", (), 1),
    ("L0/run_amp", "test_rnn", "unittest", (), 1),
    ("L0/run_amp", "test_update_scale_hysteresis", "unittest", (), 1),
    ("distributed/synced_batchnorm", "single_gpu_unit_test", "script", (), 1),
    ("distributed/synced_batchnorm", "python_single_gpu_unit_test", "script", (), 1),
    ("distributed/synced_batchnorm", "test_batchnorm1d", "script", (), 1),
    ("distributed/synced_batchnorm", "two_gpu_unit_test", "script", (), 2),
    ("distributed/synced_batchnorm", "two_gpu_unit_test", "script", ("--fp16",), 2),
    ("distributed/synced_batchnorm", "test_groups", "script", ("--group_size=2",), 2),
    ("distributed/synced_batchnorm", "two_gpu_test_different_batch_size", "script", ("--apex",), 2),
)

# left out of the CI profile: slow on CPU (s in the long profile) or checked elsewhere in CI
LONG_ONLY = {
    "L0/run_amp/test_fused_sgd.py",  # 40-65 s: Apex's amp API with FusedSGD, several models/losses/optimizers
    "L0/run_amp/test_multiple_models_optimizers_losses.py",  # 18 s: the same with torch's SGD
    "distributed/synced_batchnorm/single_gpu_unit_test.py",  # also run by test_apex_syncbn_mirror.py
    "distributed/synced_batchnorm/two_gpu_unit_test.py --fp16",
    "distributed/synced_batchnorm/test_groups.py --group_size=2",
    "distributed/synced_batchnorm/two_gpu_test_different_batch_size.py --apex",  # two ranks: about 8 s
}

NOT_MIRRORED = {
    "L0/run_mlp/test_mlp.py": "apex.mlp (MLP, fused_dense) is not mirrored",
    "L0/run_transformer/*": "apex.transformer is out of the mirror's scope",
}


def tests_root():
    """Apex's ``tests`` folder in the checkout named by ``AMP_PATCH_APEX_SRC``, or None."""
    root = os.environ.get(ENV)
    if not root or not (pathlib.Path(root) / "tests" / "L0").is_dir():
        return None
    return pathlib.Path(root) / "tests"


def profile():
    return "long" if os.environ.get(PROFILE_ENV) == "long" else "ci"


def selected(prof):
    """The entries of :data:`FILES` the profile runs (the CI profile leaves out :data:`LONG_ONLY`)."""
    return [e for e in FILES if prof == "long" or file_id(e) not in LONG_ONLY]


def file_id(entry):
    folder, stem, _, argv, _ = entry
    return f"{folder}/{stem}.py" + (f" {' '.join(argv)}" if argv else "")


def _port_for(stems, prof):
    """``{module: substitutions}`` for the child: every module of the folder gets :data:`CPU_PORT`, the named
    test files also their :data:`FILE_PORT` and (CI profile) :data:`SHRINK` entries."""
    ports = {"*": [list(p) for p in CPU_PORT]}
    for stem in stems:
        extra = list(FILE_PORT.get(stem, ())) + (list(SHRINK.get(stem, ())) if prof == "ci" else [])
        ports[stem] = ports["*"] + [list(p) for p in extra]
    return ports


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixed_batches(entries):
    """The single-process unittest files share a child (run_amp's its own: they set cudnn flags, which torch's
    common_utils, imported by the others, forbids after import), so do the single-process scripts; each
    multi-process script gets its own."""
    batches = {}
    for entry in entries:
        folder, stem, kind, argv, procs = entry
        key = (kind, folder == "L0/run_amp") if procs == 1 and not argv else entry
        batches.setdefault(key, []).append(entry)
    return list(batches.values())


TIMEOUT_S = {"ci": 900, "long": 3600}  # one batch's child; the long profile's first batch took 14 min under load


def run_files(entries, prof=None, timeout=None):
    """Run entries of :data:`FILES`; returns ``{file id: {test id: [status, message, seconds]}}``, status one
    of pass / fail / skip / ported / known."""
    results, prof = {}, prof or profile()
    timeout = timeout or TIMEOUT_S[prof]
    for batch in fixed_batches(entries):
        outcomes = _run_batch(batch, prof, timeout)
        for entry in batch:
            stem = entry[1]
            mine = {k: v for k, v in outcomes.items() if k.split("] ")[-1].startswith(stem + "::")
                    or len(batch) == 1}
            mine = mine or {"<child>": outcomes.get("<child>", ["fail", "no outcome", 0])}
            results[file_id(entry)] = _known(file_id(entry), {k: list(v) for k, v in mine.items()}, prof)
    return results


def _run_batch(batch, prof, timeout):
    _, _, kind, argv, procs = batch[0]
    stems = [e[1] for e in batch]
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        jobs, port = [], _free_port()
        for rank in range(procs):
            out = pathlib.Path(tmp) / f"out{rank}.jsonl"
            job = dict(files=[[str(tests_root() / e[0]), e[1]] for e in batch], kind=kind, port=_port_for(stems, prof),
                       ported={k.split("::", 1)[1]: v for k, v in PORTED_AWAY.items() if k.split("::")[0] in stems},
                       argv=list(argv) + ([f"--local_rank={rank}"] if procs > 1 else []), out=str(out))
            path = pathlib.Path(tmp) / f"job{rank}.json"
            path.write_text(json.dumps(job))
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) if procs > 1 else env
            jobs.append((subprocess.Popen([sys.executable, str(here / "_apex_l0_child.py"), str(path)], env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out, rank))
        return _collect(jobs, procs, timeout)


def known_failures(name, prof):
    """``{test key: (fragment, reason)}`` of :data:`KNOWN_FAILURES` for one file id in one profile."""
    return {key: spec[:2] for key, spec in KNOWN_FAILURES.get(name, {}).items()
            if len(spec) < 3 or prof in spec[2]}


def _known(name, outcomes, prof):
    for key, (fragment, _) in known_failures(name, prof).items():
        got = outcomes.get(key)
        if got is not None and got[0] == "fail" and fragment in got[1]:
            got[0] = "known"
    return outcomes


def _collect(jobs, procs, timeout):
    outcomes = {}
    for proc, out, rank in jobs:
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        tag = f"[rank {rank}] " if procs > 1 else ""
        lines = out.read_text().splitlines() if out.exists() else []
        outcomes.update({f"{tag}{key}": value for key, value in map(json.loads, lines)})
        if proc.returncode != 0:
            outcomes[f"{tag}<child>"] = ["fail", f"exit {proc.returncode}\n{text[-3000:]}", 0]
    return outcomes


def counts(outcomes):
    tally = {"pass": 0, "fail": 0, "skip": 0, "ported": 0, "known": 0}
    for status, *_ in outcomes.values():
        tally[status] += 1
    return tally


def main(argv):
    """``python tests/oracle/apex_l0.py [FILTER]``: per file counts, then each failure's first lines."""
    wanted = [e for e in FILES if not argv or any(a in file_id(e) for a in argv)]
    for name, outcomes in run_files(wanted).items():
        seconds = sum(v[2] for v in outcomes.values())
        print(f"{name}: {counts(outcomes)} ({seconds:.0f} s in tests)", flush=True)
        for key, (status, message, *_) in outcomes.items():
            if status == "fail":
                print(f"    FAIL {key}: {message.strip().splitlines()[-1][:300] if message.strip() else ''}")
    for name, reason in NOT_MIRRORED.items():
        print(f"{name}: not mirrored ({reason})")


if __name__ == "__main__":
    main(sys.argv[1:])
