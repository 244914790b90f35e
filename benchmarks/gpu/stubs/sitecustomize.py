# On the GPU machine without package access only (put this folder first on PYTHONPATH there;
# see benchmarks/RESULTS.md, "GPU benchmark: how to run it"): petals' server imports
# petals.utils.peft, which imports bitsandbytes (a 90 MB wheel, too big to bring along). No LoRA
# adapter is used by the project's servers, so a no-op module stands in for it.
import contextlib
import sys
import types

_peft = types.ModuleType("petals.utils.peft")
_peft.using_adapter = lambda name=None: contextlib.nullcontext()
_peft.estimate_adapter_memory_per_block = lambda *args, **kwargs: 0
sys.modules["petals.utils.peft"] = _peft
