"""Doctor runtime vs one O1 training run of the same steps, on the synthetic jobs of tests/_doctor_jobs.py.
Target (not asserted): doctor / one run <= 5. Each job is measured after a warm-up run (imports, YAML).

Usage: PYTHONPATH=. python benchmarks/bench_doctor.py [--steps 40] [--dtype float16|bfloat16]
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import _doctor_jobs as jobs  # noqa: E402

import amp_patch  # noqa: E402
from amp_patch.tools.doctor.training import train  # noqa: E402

JOBS = {"attention": jobs.attention_job, "layered": jobs.layered_job, "reduction": jobs.reduction_job,
        "cast": jobs.cast_job, "nan_data": jobs.nan_data_job, "log_zero": jobs.log_zero_job,
        "mlp": jobs.mlp_job}


def _seconds(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    train(jobs.mlp_job(), opt_level="O1", half_dtype=dtype, steps=2)  # warm-up
    print(f"doctor vs one O1 training run ({args.steps} steps, {args.dtype})")
    print("| job | one run s | doctor s | doctor / run | verdict |")
    print("|---|---|---|---|---|")
    for name, make in JOBS.items():
        run_s, _ = _seconds(lambda make=make: train(make(), opt_level="O1", half_dtype=dtype, steps=args.steps))
        doc_s, report = _seconds(lambda make=make: amp_patch.doctor(make(), half_dtype=dtype, steps=args.steps))
        print(f"| {name} | {run_s:.2f} | {doc_s:.2f} | {doc_s / run_s:.2f} | {report.status} |")


if __name__ == "__main__":
    main()
