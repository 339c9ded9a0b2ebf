"""Which op lists of an experiment put ops in the ``fp8`` category (the machine line then says whether float8
runs on hardware here)."""
from ...config.oplist import load_op_lists
from ...errors import AmpPatchError


def uses_fp8(specs):
    """Whether any of ``specs`` (op-list specs as ``load_op_lists`` takes them) has an fp8 entry, global or scoped."""
    for spec in specs:
        try:
            table = load_op_lists(spec)
        except AmpPatchError:  # the experiment already refused a broken list before any run
            continue
        if table.counts().get("fp8") or any(e.category == "fp8" for s in table.scopes for e in s.entries):
            return True
    return False
