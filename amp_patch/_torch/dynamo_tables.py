"""torch.compile's tables of torch functions, kept built from torch's own functions while amp_patch patches them.

dynamo builds, once per process (``functools.cache``), a table of the torch functions it puts into graphs, by
looking names such as ``"torch.bmm"`` up with ``getattr``. ``torch.distributed.init_process_group`` clears it.
Rebuilt while a session has ``torch.bmm`` patched, the table holds amp_patch's wrapper instead of torch's ``bmm``:
that session's graphs call the wrappers opaquely, and every later session's new wrappers reach a ``bmm`` dynamo
no longer knows, one graph break per patched call. So the tables are built before patching and forgotten after
unpatching. (A process group created *inside* a session still leaves that session's graphs calling the
wrappers; the sessions after it are right again.)
"""
from .compat import internal

_NEEDED = ("get_torch_obj_rule_map", "get_tensor_method", "clear_lru_cache")


def _trace_rules():
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch without dynamo: nothing to keep right
        return None
    for name in _NEEDED:  # looked up here: a torch that renamed one gets an error naming it and its version
        internal(f"torch._dynamo.trace_rules.{name}", "to keep torch.compile's table of torch functions free of "
                 "amp_patch's wrappers")
    return trace_rules


def build_before_patching():
    """Build dynamo's tables now, from torch's own functions (a no-op when they are built already); returns the
    table, for :func:`forget_after_unpatching`."""
    rules = _trace_rules()
    if rules is None:
        return None
    rules.get_tensor_method()
    return rules.get_torch_obj_rule_map()


def forget_after_unpatching(built):
    """Drop dynamo's tables if they were rebuilt since :func:`build_before_patching` returned ``built`` (then they
    may hold amp_patch's wrappers); the next compile rebuilds them from torch's own functions. Untouched tables
    stay, so an ``amp_patch.autocast()`` region per batch costs no rebuild."""
    rules = _trace_rules()
    if rules is None or rules.get_torch_obj_rule_map.cache_info().currsize == 0:
        return  # cleared and not rebuilt since: nothing of amp_patch's in it
    if rules.get_torch_obj_rule_map() is not built:
        rules.clear_lru_cache()
