"""torch.compile's tables of torch functions, kept built from torch's own functions while amp_patch patches them.

dynamo builds, once per process (``functools.cache``), a table of the torch functions it puts into graphs, by
looking names such as ``"torch.bmm"`` up with ``getattr``. ``torch.distributed.init_process_group`` clears it.
Rebuilt while a session has ``torch.bmm`` patched, the table holds amp_patch's wrapper instead of torch's ``bmm``:
that session's graphs call the wrappers opaquely, and every later session's new wrappers reach a ``bmm`` dynamo
no longer knows, one graph break per patched call. So the tables are built before patching and forgotten after
unpatching. (A process group created *inside* a session still leaves that session's graphs calling the
wrappers; the sessions after it are right again.)
"""


def _trace_rules():
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch without dynamo: nothing to keep right
        return None
    return trace_rules


def build_before_patching():
    """Build dynamo's tables now, from torch's own functions (a no-op when they are built already)."""
    rules = _trace_rules()
    if rules is not None:
        rules.get_torch_obj_rule_map()
        rules.get_tensor_method()


def forget_after_unpatching():
    """Drop dynamo's tables, so the next compile rebuilds them from whatever torch holds then."""
    rules = _trace_rules()
    if rules is not None:
        rules.clear_lru_cache()
