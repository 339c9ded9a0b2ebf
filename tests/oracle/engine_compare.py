"""Two O1 casting engines run the same program; what they produce is compared bit for bit.

The oracle is ``cast_engine="python"`` (every op of the list cast by its Python wrapper, the engine amp_patch had
before the hybrid one). ``compare_jobs`` trains each ``(name, build)`` job a few steps under both engines (same
seed, same batch) and reports every difference in a loss, a module's output (dtype and bits), a grad or a
param; ``compare_ops`` calls op_db samples inside a forward of a session model under both engines and reports the
ops whose outputs (or errors) differ. Both return lists of strings (empty: the engines agree), for tests and for
a person reading a failure. Another comparer (tests/oracle's OpInfo one, the zoo of real architectures) can hand
its jobs to :func:`compare_jobs` unchanged.
"""
import copy

import torch

import amp_patch


def _bits(t):
    """The tensor's bytes (NaN payloads included), whatever its layout and strides."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.reshape(-1).clone().view(torch.uint8)


def tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors(v)]
    return [x]


def differences(a, b, where):
    """Where ``a`` and ``b`` differ (structure, dtype, shape or bits), as strings."""
    fa, fb = tensors(a), tensors(b)
    if len(fa) != len(fb):
        return [f"{where}: {len(fa)} vs {len(fb)} results"]
    found = []
    for i, (x, y) in enumerate(zip(fa, fb)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if (x.dtype, x.shape) != (y.dtype, y.shape):
                found.append(f"{where}[{i}]: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
            elif not torch.equal(_bits(x), _bits(y)):
                found.append(f"{where}[{i}]: {x.dtype} values differ")
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or (x != y and x == x):
            found.append(f"{where}[{i}]: {x!r:.40} vs {y!r:.40}")
    return found


def _outputs(model, seen):
    handles = []
    for path, module in model.named_modules():
        def hook(_module, _args, out, path=path):
            seen.setdefault(path, []).append([t.detach().clone() for t in tensors(out) if isinstance(t, torch.Tensor)])
        handles.append(module.register_forward_hook(hook))
    return handles


def run_job(build, engine, *, steps=2, half_dtype=torch.bfloat16, op_lists=None):
    """``build() -> (model, batch, loss_fn)`` trained ``steps`` steps under O1 with ``engine``: a record."""
    torch.manual_seed(0)
    model, batch, loss_fn = build()
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=half_dtype, verbosity=0,
                                      op_lists=op_lists, cast_engine=engine)
    record = {"loss": [], "outputs": {}, "grads": []}
    handles = _outputs(model, record["outputs"])
    try:
        for _ in range(steps):
            torch.manual_seed(1)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch))
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            record["grads"].append([p.grad for p in model.parameters()])
            opt.step()
            record["loss"].append(loss.detach())
    finally:
        for handle in handles:
            handle.remove()
        amp_patch.deinitialize()
    record["params"] = [p.detach() for p in model.parameters()]
    return record


def compare_jobs(jobs, **options):
    """Every difference between the engines over ``jobs`` (``(name, build)`` pairs)."""
    found = []
    for name, build in jobs:
        a, b = run_job(build, "python", **options), run_job(build, "hybrid", **options)
        found += differences(a["loss"], b["loss"], f"{name}: loss")
        for path in a["outputs"]:
            found += differences(a["outputs"][path], b["outputs"].get(path), f"{name}: output of {path or 'model'}")
        found += differences(a["grads"], b["grads"], f"{name}: grads")
        found += differences(a["params"], b["params"], f"{name}: params")
    return found


class _Calls(torch.nn.Module):
    """A session model whose forward runs each call (seeded), keeping its result or the error's type."""

    def __init__(self, calls):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls = calls

    def forward(self):
        results = []
        for call in self.calls:
            torch.manual_seed(0)
            try:
                results.append(call())
            except Exception as exc:  # noqa: BLE001 - an op that raises must raise under both engines
                results.append(f"raised {type(exc).__name__}")
        return results


_NAMESPACES = (torch, torch.Tensor, torch.nn.functional, torch.linalg, torch.special, torch.fft)


def _late_bound(fn):
    """``fn`` looked up by name at each call where it is a torch namespace's attribute: OpInfo holds the function
    it found at import, which no patch reaches (the comparison is of the casting policy, not of early binding:
    native autocast casts an early-bound call in a fast region, the Python engine cannot)."""
    for namespace in _NAMESPACES:
        name = next((k for k, v in vars(namespace).items() if v is fn), None)
        if name is not None:
            return lambda *args, **kwargs: getattr(namespace, name)(*args, **kwargs)
    return fn


_UNINITIALIZED = ("empty", "new_empty")  # their values are whatever memory held: not a casting question


def op_calls(ops, samples_per_op=2):
    """``(name, call)`` per sample of each OpInfo in ``ops`` (float32 inputs on CPU)."""
    calls = []
    for op in ops:
        if torch.float32 not in op.supported_dtypes("cpu") or op.name.startswith(_UNINITIALIZED):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:samples_per_op]
        except Exception:  # noqa: BLE001,S112 - an OpInfo whose sampler fails here is not a casting question
            continue
        for i, s in enumerate(samples):
            fn = _late_bound(op.op)
            calls.append((f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}#{i}",
                          lambda fn=fn, s=s: fn(s.input, *s.args, **s.kwargs)))
    return calls


def compare_ops(calls, *, half_dtype=torch.bfloat16, op_lists=None):
    """The ops whose results differ between the engines, each called inside a forward of a session's model."""
    results = {}
    for engine in ("python", "hybrid"):
        model = amp_patch.initialize(_Calls([call for _, call in calls]), opt_level="O1", half_dtype=half_dtype,
                                     verbosity=0, op_lists=op_lists, cast_engine=engine)
        try:
            results[engine] = model()
        finally:
            amp_patch.deinitialize()
    found = []
    for (name, _), a, b in zip(calls, results["python"], results["hybrid"]):
        found += differences(a, b, name)
    return found
