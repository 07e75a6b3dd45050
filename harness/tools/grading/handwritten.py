"""The hand-written FSDP must be hand-written: no route through PyTorch's FSDP2.

Two layers, because each closes what the other cannot:

- `static_problem(path)` reads the submission's source (never runs it) against an allowlist:
  the imports, every attribute name and the builtins a hand-written FSDP needs, and nothing
  that reaches a module, globals, frames or code by another route, turns a string into code,
  loads code, reads or writes files, adds pickling hooks or changes torch's or Python's own
  objects (which the checks running next to it in the same process use).
- At run time, whatever route was taken: FSDP2's classes, module state or hooks on the
  wrapped model (`model_problem`), FSDP2's custom ops (`fsdp::...`) or FSDP2's source files
  on the Python stack of any collective (`stack_problem`, called by jobs.CommLog).

Either one fails every graded test with FSDP2_USED.
"""

from __future__ import annotations

import abc
import ast
import builtins
import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
import operator
import os
import string
import sys
import typing
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from harness import impl
from harness.impl import stored_attribute

FSDP2_USED = "uses PyTorch's FSDP2, not your own"
OUTSIDE = "reaches beyond a hand-written FSDP"


class Outside(str):
    """A source problem that is not FSDP2 itself: a construct a hand-written FSDP does not need."""


def verdict(problem: str) -> str:
    """The failure message for a problem found by any check here."""
    return f"{OUTSIDE if isinstance(problem, Outside) else FSDP2_USED} ({problem})"

# Source folders of FSDP2 (and FSDP1, which shares the package): code running from here is FSDP2.
_FSDP_DIRS = tuple(os.path.join(os.path.dirname(torch.__file__), "distributed", d) + os.sep
                   for d in ("fsdp", os.path.join("_composable", "fsdp")))
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable")

# ----------------------------------------------------------------------------- the source check
#
# An allowlist, because a list of refused names was beaten: in Python a module is an attribute of
# other modules (`torch.os`, `logging.sys`), a string becomes code wherever something evaluates it,
# and an object's attributes lead to its globals, its frames and its code. So the file may use
# only what a hand-written FSDP needs: every attribute name it reads or writes is either the public
# API of torch's allowed modules and the standard helpers (introspected from the installed torch,
# so it follows the version) or a name the file defines itself; and neither may be a module outside
# the allowed ones, a frame or code attribute, a dunder outside a short list, or an entry point that
# loads, compiles or evaluates code, reads or writes files, or unpickles.

# Modules an FSDP may import (exactly these). Not importlib, sys, inspect, gc, ctypes, builtins,
# subprocess, pickle, logging.config, nor torch's code loaders (jit, fx, library, package, hub,
# utils.cpp_extension, ops, _C): each reaches modules, frames, files or code by computed names.
STDLIB_IMPORTS = {"__future__", "math", "dataclasses", "enum", "typing", "collections", "collections.abc",
                  "functools", "itertools", "contextlib", "weakref", "abc", "operator", "warnings", "logging",
                  "time", "os"}
TORCH_IMPORTS = {"torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.nn.parameter",
                 "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.placement_types",
                 "torch.distributed.device_mesh", "torch.autograd", "torch.autograd.graph", "torch.autograd.function",
                 "torch.profiler", "torch.compiler", "torch.cuda", "torch.accelerator", "torch.utils.hooks"}
ALLOWED_IMPORTS = STDLIB_IMPORTS | TORCH_IMPORTS
OS_ATTRS = {"environ", "getenv", "getpid", "cpu_count"}  # reading settings; not files, not processes
# logging's loggers and levels; not its formatters, handlers or config, whose format strings walk the
# attributes of whatever they format (`{record.args.__class__...}` with style="{")
LOGGING_ATTRS = {"getLogger", "Logger", "NOTSET", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "debug", "info",
                 "warning", "error", "exception", "critical", "log"}
MODULE_ATTRS = {"os": (OS_ATTRS, "settings, not files or processes"),
                "logging": (LOGGING_ATTRS, "loggers and levels, not formatters, handlers or config")}
"""modules of which a file may use only some names, and what those are"""
ENVIRON_ATTRS = {"get", "items", "keys", "values", "copy"}  # os.environ is read, never changed
# Attribute names of the allowed modules that are themselves allowed modules (torch.nn, nn.functional...).
SUBMODULE_ATTRS = {m.rsplit(".", 1)[-1] for m in TORCH_IMPORTS if "." in m} | {"abc"}
# Names that are methods or attributes an FSDP uses (nn.Module.modules(), Tensor.grad, Tensor.cpu(),
# F.linear, a parameter called `module`) and also, on some allowed module, a submodule of torch's
# (torch.nn.modules, torch.nn.grad, torch.cpu, torch.nn.modules.linear...): allowed, and every module
# they reach is searched like the allowed ones, so that its own module-valued attributes are refused.
SHADOWED_MODULE_ATTRS = {"modules", "module", "grad", "cpu", "storage", "flatten", "linear", "dropout", "fold",
                         "sparse", "copy"}
# Private names an FSDP needs: the engine's end-of-backward callback (FSDP2 and DDP use it too),
# a module's tables and its _apply (to_empty), a namedtuple's fields, and a tensor's post-accumulate-grad
# hooks (an FSDP sets the sharded gradient itself, so it must run them as autograd would; FSDP2 does).
PRIVATE_ATTRS = {"_execution_engine", "_parameters", "_buffers", "_modules", "_apply", "_fields",
                 "_post_accumulate_grad_hooks"}

# Names refused wherever they appear, each with what to do instead.
_COMPUTED = "import what you need with a plain `import torch...` at the top and use it by name"
_ARGS = "pass what you need as arguments or keep it on your objects"
_CODE = "write the code out in the file"
_FILES = "the FSDP computes its results; it reads no files and runs no programs"
_HARNESS = ("harness", "train", "checks", "handwritten")
_FSDP2_NAMES = ("fsdp", "_composable", "_composable_state", "_fully_shard")
STORAGE_CLASSES = tuple(sorted(n for n in dir(torch) if n.endswith("Storage"))) + ("StorageBase", "_StorageBase")
"""torch's storage classes (UntypedStorage, TypedStorage, FloatStorage...): a storage made by the file's own call"""
ADVICE = {
    **dict.fromkeys(_FSDP2_NAMES, "write the FSDP yourself: torch.distributed's collectives and DTensor are all it needs"),
    **dict.fromkeys(_HARNESS, "the FSDP must not reach the harness that grades it; nothing in it is needed"),
    **dict.fromkeys(("sys", "importlib", "import_module", "builtins", "__builtins__", "__import__",
                     "attrgetter", "methodcaller"), _COMPUTED),
    # Strings that become code (evaluated annotations included), and compiled or loaded code.
    # typing's run-time forms that hand out Python's own type (get_origin(Type[X]), Type[X](...)) or make a class
    # whose annotations, which dataclass compiles into code, come from any strings (TypedDict's functional form)
    **dict.fromkeys(("get_origin", "Type", "TypedDict"),
                    "annotate with the builtin names (type[X], dict[str, X]); typing's run-time forms are not needed"),
    **dict.fromkeys(("exec", "eval", "compile", "cpp_extension", "load_inline", "get_type_hints", "ForwardRef",
                     "singledispatch", "singledispatchmethod", "make_dataclass", "load_library", "CompilationUnit",
                     "import_ir_module", "import_ir_module_from_buffer", "parse_ir", "ScriptFunction",
                     "ScriptModule", "ScriptObject", "ScriptClass", "ScriptMethod", "LiteScriptModule",
                     "load_compiled_function", "load_cache_artifacts", "save_cache_artifacts",
                     "CUDAPluggableAllocator", "change_current_allocator", "breakpoint"), _CODE),
    **dict.fromkeys(("globals", "locals", "vars", "_getframe", "currentframe", "gc", "ctypes", "inspect", "mro"),
                    _ARGS),
    # torch calling a Python function of the file per element, inside the call: where the collective log is off
    **dict.fromkeys(("apply_", "map_", "map2_"), "it calls a Python function on each element inside torch's call, "
                    "where the collective log cannot see what it reads: write tensor ops"),
    # a backward of the file's own through the engine; a function of the file's handed to the function modes as a
    # call of torch's; numpy arrays over a tensor's memory (what `numpy` itself is refused for)
    "run_backward": "an FSDP never differentiates: the training loop's loss.backward() runs its hooks",
    **dict.fromkeys(("handle_torch_function", "wrap_numpy"),
                    "it runs the file's code as if it were torch's, past what watches torch's calls: call torch"),
    # AttributeError's: the object a lookup failed on, whatever it is (torch's module, handed out as a value)
    "obj": "it is the object a failed lookup was made on (a module of torch's, say): read the exception's message "
           "(str(e)), and name your own attribute otherwise",
    **dict.fromkeys(("init_process_group", "destroy_process_group", "abort_process_group", "new_group", "rendezvous", "ProcessGroupGloo", "ProcessGroupNCCL",
                     "ProcessGroupMPI", "ProcessGroupUCC", "ProcessGroupXCCL", "FakeProcessGroup",
                     "ProcessGroupWrapper", "get_group_store", "Store"),
                    "the process group is set up before the FSDP runs (a store is a file or a socket): use the "
                    "mesh fully_shard is given, or DeviceMesh over its ranks"),
    **dict.fromkeys(("open", "subprocess", "serialization", "_open_file", "_open_zipfile_reader",
                     "_open_zipfile_writer", "save", "load", "PyTorchFileReader", "PyTorchFileWriter",
                     "FileStore", "TCPStore", "HashStore", "PrefixStore", "export_chrome_trace", "export_stacks",
                     "export_memory_timeline", "tensorboard_trace_handler", "ExecutionTraceObserver", "basicConfig",
                     "FileHandler", "handlers", "addHandler", "Handler", "StreamHandler", "setLoggerClass",
                     "setLogRecordFactory", "showwarning", "formatwarning", "input", "help",
                     # a warning's source line read from any file it names; the standard streams redirected
                     "warn_explicit", "redirect_stdout", "redirect_stderr", "debug_dump", "enable_debug_mode"), _FILES),
    # Waits no trace marks as one (Work.wait is marked: harness/tools/traces/schedule.py), and a way to any module;
    # is_success() raises until the work is done: a poll outside the ways to wait the marks stand in for.
    **dict.fromkeys(("boxed", "unbox", "is_success"),
                    "wait for a collective with its work handle's wait(), which the overlap check sees"),
    "get_device_module": _COMPUTED,
    # A context entered on a stack that may never be closed stays on for the whole process.
    **dict.fromkeys(("ExitStack", "AsyncExitStack"), "enter a context with a `with` statement, which also leaves it"),
    # Changes torch's or Python's tables that outlive the file: its backends, an item of a container it did
    # not make, the classes an enum is made from at run time, a generic's argument classes.
    **dict.fromkeys(("register_backend", "setitem", "delitem", "EnumType", "EnumMeta", "get_args"),
                    "an FSDP changes its own objects only; write x[k] = v on your own containers, enums as classes"),
    # Write onto whatever they are handed (a marker attribute, a wrapper's table), which the check cannot tell is the
    # file's own (a class kept in a list is torch's): not needed to write an FSDP.
    # Reads its index tensor's values in C++ (const_data_ptr), where no op shows the read: a poll of a collective's
    # output the log cannot see before its wait.
    "tensor_split": "split a tensor with split() or chunk(), whose sizes are numbers",
    # The same, for the recurrent layers' packed sequences (their batch sizes) and tensordot (a tensor of dims, read
    # by .tolist() in torch's own Python): an FSDP runs no layer of its own, and contracts with matmul or einsum.
    **dict.fromkeys(("rnn_tanh", "rnn_relu", "lstm", "gru"), "an FSDP runs the model's modules, no recurrent layer "
                    "of its own"),
    "tensordot": "contract with matmul or einsum, whose dimensions are numbers",
    # Compile or trace the file's own functions (torch.compile under other names), where the check and the log do
    # not follow them.
    **dict.fromkeys(("cond", "while_loop", "vmap"), "write plain Python control flow and loops"),
    **dict.fromkeys(("dataclass_transform", "update_abstractmethods", "assume_constant_result",
                     "nested_compile_region", "boolean_dispatch"),
                    "it writes onto what it is given (torch's classes too, for the whole process); an FSDP needs "
                    "none of it: remove it"),
    # enum's global_* copy a class's members into the module its __module__ names (any module: torch's, the
    # harness's, builtins), replacing what is there.
    **dict.fromkeys(("global_enum", "global_enum_repr", "global_str", "global_flag_repr"),
                    "an enum stays in its class: write Name.member"),
    # Process-wide settings the harness relies on for the same numbers as FSDP2 and for what it measures.
    **dict.fromkeys(("set_default_dtype", "set_default_device", "set_default_tensor_type",
                     "set_float32_matmul_precision", "use_deterministic_algorithms", "manual_seed",
                     "set_num_threads", "set_num_interop_threads", "set_detect_anomaly", "set_stance",
                     "set_grad_enabled", "reset_peak_memory_stats", "reset_max_memory_allocated",
                     "reset_accumulated_memory_stats", "simplefilter", "filterwarnings", "resetwarnings",
                     "allow_in_graph", "substitute_in_graph", "no_type_check", "register", "set_anomaly_enabled",
                     "set_autocast_cpu_dtype", "set_autocast_cpu_enabled", "set_autocast_enabled", "set_autocast_dtype",
                     "set_autocast_gpu_dtype", "set_autocast_cache_enabled", "set_debug_level",
                     "set_debug_level_from_env", "set_rng_state", "set_flush_denormal", "set_warn_always",
                     "register_optimizer_step_post_hook", "register_rendezvous_handler", "caching_allocator_enable",
                     "set_per_process_memory_fraction", "skip_guard_on_globals_unsafe", "set_enable_guard_collectives",
                     "set_multithreading_enabled", "set_stream", "erase_step_count", "increment_step",
                     "set_sync_debug_mode", "set_warn_on_accumulate_grad_stream_mismatch",
                     "reset_max_memory_cached", "reset_peak_host_memory_stats", "default_generator",
                     "manual_seed_all", "seed_all", "set_rng_state_all", "fork_rng", "initial_seed", "chdir",
                     "seed", "set_deterministic_debug_mode", "set_autocast_ipu_dtype", "set_autocast_ipu_enabled",
                     "set_autocast_xla_dtype", "set_autocast_xla_enabled", "set_printoptions", "set_vital",
                     "setLevel", "addFilter", "removeFilter", "removeHandler"),
                    "an FSDP changes no process-wide setting, registry or filter (train.py sets them): use "
                    "`with torch.no_grad():` where gradients must not be recorded"),
    # Ops hidden from the dispatcher's Python modes, where the collective log and its FSDP2 check run.
    **dict.fromkeys(("ExcludeDispatchKeyGuard", "DispatchKeySet", "DispatchKey", "DisableTorchFunction",
                     "DisableTorchFunctionSubclass"),
                    "an FSDP runs its ops as anyone does: torch's dispatch keys are not its to change"),
    # Reads and writes attributes named by its arguments (assigned=, updated=), onto any object.
    "update_wrapper": "decorate your own function with @functools.wraps(f)",
    # get_future() returns at once on gloo, the work still running: a group it "waited" for early looked
    # released while its all-gather ran (an all-gather more in flight than the check counted).
    **dict.fromkeys(("sleep", "block_current_stream", "get_future_result", "get_future"),
                    "wait for a collective with its work handle's wait(), which the overlap check sees"),
    # A tensor's values read into Python without an op the collective log sees (a collective's output polled
    # before its wait: [Note: a collective's result read before its wait] in jobs.py).
    **dict.fromkeys(("tolist", "numpy"), "read a value with .item(), or print the tensor"),
    # A profiler of its own would read the names of the grader's ranges (harness/tools/traces/schedule.py).
    **dict.fromkeys(("profile", "key_averages", "events", "emit_nvtx", "emit_itt"),
                    "an FSDP never runs a profiler: train.py profiles (--profile-steps); label your phases with "
                    "record_function"),
    # Differentiation of its own runs autograd's nodes, which the overlap check counts as the model's compute.
    **dict.fromkeys(("vjp", "jvp", "jacobian", "hessian", "hvp", "vhp"),
                    "an FSDP never differentiates: the training loop's loss.backward() runs its hooks"),
    # Saved-tensor hooks run inside autograd's backward nodes, which the overlap check counts as the model's compute.
    **dict.fromkeys(("saved_tensors_hooks", "save_on_cpu", "disable_saved_tensors_hooks", "register_hooks"),
                    "an FSDP never needs saved-tensor hooks: they run inside the model's backward, where the "
                    "overlap check counts only the model's compute"),
    # A numpy array's methods write files (tofile, dump): the FSDP works on tensors.
    "numpy": "work on tensors: an FSDP never needs numpy",
    # Each unpickles what another process sent.
    **dict.fromkeys(("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                     "send_object_list", "recv_object_list"),
                    "send tensors with the tensor collectives; these unpickle what another process sent"),
    # Formatters apply str.format to the log record, which reads attributes named in the string.
    **dict.fromkeys(("format_map", "Formatter"), "use an f-string, whose fields are code the check reads"),
    # Hooks on every module in the process, the harness's included.
    **dict.fromkeys(("register_module_forward_hook", "register_module_forward_pre_hook",
                     "register_module_full_backward_hook", "register_module_full_backward_pre_hook",
                     "register_module_backward_hook", "register_module_buffer_registration_hook",
                     "register_module_module_registration_hook", "register_module_parameter_registration_hook"),
                    "register hooks on the modules you wrap (module.register_forward_pre_hook...)"),
    # Tensors of a class of torch's own that an FSDP never needs: an uninitialized parameter or buffer with another
    # tensor's data put in (`.data = t`) wrote and read that memory beside the collective log's view of plain ones.
    **dict.fromkeys(("UninitializedBuffer", "UninitializedParameter", "UninitializedTensorMixin"),
                    "an FSDP's tensors are plain tensors and nn.Parameter: work on the parameters and buffers you "
                    "make with torch.empty and nn.Parameter"),
    # Storages of the file's own making, and a storage's bytes rewritten where no op shows it: what a storage is for
    # is [Note: a storage's bytes]'s, the collective log follows bytes through ops only (jobs.py's [Note: where the
    # model's parameters came from]).
    **dict.fromkeys((*STORAGE_CLASSES, "byteswap", "_byteswap", "_set_cdata", "_set_from_file"),
                    "allocate with torch.empty and free with x.untyped_storage().resize_(0): an FSDP's storages are "
                    "its tensors', used for " + ", ".join(f".{n}()" for n in ("resize_", "size", "nbytes", "data_ptr"))),
    # A random generator's state set from data: what it then draws is that data, which no op carried.
    **dict.fromkeys(("set_state", "graphsafe_set_state", "clone_state", "set_offset"),
                    "an FSDP draws no random numbers: it moves the parameters the model has"),
    # Storage outside torch's CPU allocator, which the graded memory check counts (harness/memory.py).
    **dict.fromkeys(("share_memory_", "share_memory", "from_file", "_share_filename_", "_share_fd_", "_new_shared",
                     "_new_shared_filename", "_new_shared_fd", "frombuffer", "asarray", "from_buffer",
                     "from_dlpack", "bytearray", "memoryview"),
                    "allocate with torch's ordinary allocator (torch.empty, new_zeros...): the graded memory "
                    "check counts its tensors, and shared, file-backed or borrowed (Python buffer) storage "
                    "would hide from it"),
    # A weak value dictionary removes a dead value's entry by looking its key up, comparing keys with `==` (a
    # tensor's: an op), wherever the value goes: inside a kernel of torch's that freed it too, where the collective
    # log's modes are off and the code that runs is Python's own, which no mark of the file's names.
    "WeakValueDictionary": "keep plain weak references (weakref.ref(x)), a WeakKeyDictionary or a WeakSet, and look "
                           "your values up where you use them",
    # Quantized and sparse tensors hold other tensors inside them (a quantizer's scales, a sparse tensor's values),
    # which torch's kernels free inside an op, where nothing watches what that runs.
    **dict.fromkeys(sorted({n for n in dir(torch) + dir(torch.Tensor) + dir(torch.nn.functional)
                            if ("quantiz" in n.lower() or "sparse" in n.lower()) and not n.startswith("is_")}
                           | {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}),
                    "an FSDP's tensors are plain dense ones (torch.empty, nn.Parameter): a quantized or sparse tensor "
                    "keeps other tensors inside it, which torch's kernels free where the grader cannot see what runs"),
}
FORBIDDEN_NAMES = set(ADVICE)
# Parts of an import's dotted name refused with their own advice; any other module outside
# ALLOWED_IMPORTS gets "remove the import".
_IMPORT_PARTS = set(_FSDP2_NAMES) | set(_HARNESS) | {"serialization", "cpp_extension"}
# What a file's classes may derive from besides its own: object and the exceptions (builtins, by name),
# enums, typing's generics, abc.ABC, and what FSDP builds on.
_SAFE_BUILTIN_BASES = {n for n, v in vars(builtins).items()
                       if isinstance(v, type) and (v is object or issubclass(v, BaseException))}
ALLOWED_BASES = (abc.ABC, typing.Generic, typing.Protocol, typing.NamedTuple)
SUBCLASSED_BASES = (torch.nn.Module, torch.autograd.Function, enum.Enum, BaseException)
# Builtins that evaluate, import, open or reach what the file did not write.
# The builtins that read and write attributes by name: a file may only call them with its arguments
# written out, and never rebinds them (impl.load gives the file setattr and delattr that refuse
# torch's classes, modules and functions, which a name computed at run time could otherwise reach).
# [Note: a storage's bytes]
# A tensor's storage is how an FSDP frees the gathered parameters and gets the memory back
# (`x.untyped_storage().resize_(0)`, FSDP2's way), and how it tells whether two tensors share memory
# (`.data_ptr()`). Anything else done with it is memory the collective log follows only through tensors:
# a storage read through, handed around or resized while a collective writes into it moves or exposes
# the collective's output where no op shows it (the log's check that no output is read before its work
# handle was waited for: jobs.py's [Note: a collective's result read before its wait]; the log follows a
# resize too, this keeps what it must follow small). So a storage is used only as the receiver of
# STORAGE_USES (resize_, which returns the storage, as a statement of its own), in place or through a
# function's local name read nowhere else, and a typed storage (`x.storage()`) not at all.
STORAGE_GETTERS = ("untyped_storage", "storage")
STORAGE_USES = ("resize_", "size", "nbytes", "data_ptr")
_STORAGE_USES = ", ".join(f".{n}()" for n in STORAGE_USES)
ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr", "delattr")
GUARDED_BUILTINS = (*ATTRIBUTE_BUILTINS, "type")  # the loader gives the file its own setattr, delattr and type
# Instance attributes of the standard helpers' objects that hold their internals: a @contextmanager's generator
# (resumed by hand, its context stays on past the with block), warnings.catch_warnings' module, the redirect
# contexts' streams, an ExitStack's callbacks, logging's manager, its loggers, a logger's filters and handlers (a
# list changed in place past addFilter). Not the API, and not
# introspected (set in __init__): the file's own attributes take these names only on `self`.
INTERNAL_ATTRS = {"gen", "_module", "_old_targets", "_new_target", "_exit_callbacks", "manager", "loggerDict", "filters",
                  "handlers", "hooks_dict_ref", "extra_dict_ref"}
CLASS_DECORATORS = (dataclasses.dataclass, functools.total_ordering, enum.unique, typing.final)
"""what may decorate a class of the file: each returns the class it is given (by identity: functools.partial(f) or any
other wrapper of a function would put f's result under the class's name)"""
READING_METHODS = {"get", "setdefault", "add", "append", "pop", "discard", "remove", "index", "count", "debug", "info",
                   "warning", "error", "exception", "critical", "log"}
"""methods of the file's own containers and loggers that may take a class (a cache keyed by it, a message naming it)"""
# Classes whose `case C(x)` matches the subject itself (not an attribute of it).
SELF_MATCHING = {"bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list", "set", "str", "tuple"}
REFUSED_BUILTINS = {"eval", "exec", "compile", "globals", "locals", "vars", "__import__", "open", "input",
                    "breakpoint", "help", "exit", "quit", "__builtins__", "__loader__", "__spec__", "bytearray",
                    "memoryview"}
# Dunders a file may read or write (`x.__name__`, `__slots__ = ...`): none leads to a module,
# globals, code or a frame. Not `__annotations__` (dataclass writes its keys into the source of the
# __init__ it compiles), `__dict__`, `__mro__`, `__subclasses__`, `__globals__`, `__self__`...
ALLOWED_DUNDERS = {"__init__", "__class__", "__name__", "__qualname__", "__module__", "__enter__", "__exit__",
                   "__call__", "__post_init__", "__repr__", "__str__", "__len__", "__iter__", "__next__",
                   "__getitem__", "__setitem__", "__contains__", "__bool__", "__eq__", "__ne__", "__lt__", "__le__",
                   "__gt__", "__ge__", "__hash__", "__slots__", "__doc__", "__all__", "__future__", "__main__",
                   "__version__", "__debug__"}
# Methods a file's classes may define: none runs at a moment the file does not choose (pickling,
# class creation, attribute lookup, garbage collection).
ALLOWED_METHODS = ALLOWED_DUNDERS - {"__class__"} | {"__delitem__", "__add__", "__sub__", "__mul__", "__truediv__",
                                                     "__floordiv__", "__neg__", "__int__", "__float__", "__index__"}
# `__class__` is read (`x.__class__`) or assigned on an object (a module's class swapped), never defined in a class's
# namespace: isinstance believes what it says, so an object of the file's would pass for a dataclasses.Field (whose
# name dataclass compiles into code) or for one of torch's.
PICKLING_HOOKS = {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs__",
                  "__getnewargs_ex__", "__copy__", "__deepcopy__"}
_PICKLE_ADVICE = ("a pickling hook runs code wherever the object is unpickled (the grader's side); an FSDP's "
                  "objects are never pickled: remove it")
_PUBLIC_API = "use the public API (torch, torch.distributed, DTensor, nn, autograd)"


@functools.lru_cache(maxsize=None)
def _torch_callables() -> frozenset[str]:
    """Names of the functions and methods of torch, its tensors, modules and collectives (not data
    attributes such as `.grad`, `.data` or `.requires_grad`, which an FSDP sets)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    owners = (torch, torch.Tensor, torch.nn.Module, torch.nn.Parameter, dist, F, dist.Work, torch.profiler.profile,
              torch.autograd.Function, torch.UntypedStorage)
    return frozenset(n for o in owners for n in dir(o) if not _dunder(n)
                     and callable(inspect.getattr_static(o, n, None)) and not isinstance(inspect.getattr_static(o, n, None), type)
                     and not isinstance(inspect.getattr_static(o, n, None), property))


def _decorated(func: ast.FunctionDef | ast.AsyncFunctionDef, *names: str) -> bool:
    return any(isinstance(d, ast.Name) and d.id in names for d in func.decorator_list)


READING_BUILTINS = {"len", "sorted", "list", "dict", "set", "tuple", "frozenset", "iter", "enumerate", "any", "all", "sum",
                    "min", "max", "zip", "reversed", "repr", "str", "print", "bool", "isinstance"}
# The builtins the check reads by their name (a class's safe base, a call that only reads what it is given, a
# decorator, a class `case C(x)` matches itself with): a file binds none of them.
TRUSTED_BUILTINS = frozenset(_SAFE_BUILTIN_BASES | READING_BUILTINS | SELF_MATCHING | {
    "isinstance", "issubclass", "id", "hash", "repr", "str", "print", "staticmethod", "classmethod", "property",
    "super", "object", "callable", "hasattr", "getattr", "ValueError", "type"})
_ENUM_API_KEYWORDS = {"names", "module", "qualname", "type", "start", "boundary"}
"""the keywords of enum's functional API (`E("X", names, type=...)`)"""
SLOTS_DUNDERS = {"__weakref__", "__dict__"}
"""What a slotted class names in its `__slots__` to be weakly referenced or take attributes beyond its slots."""
ENUM_MIXINS = {mixin.__name__ for mixin in impl.ENUM_MIXINS}
"""the names of the builtins an enum may mix in (the loader's ENUM_MIXINS), which the check trusts by their name"""
CONTAINER_MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
                      "add", "discard", "sort", "reverse", "difference_update", "intersection_update",
                      "symmetric_difference_update", "__setitem__", "__delitem__", "__iadd__", "__ior__"}


# What a file may use only as a decorator of its own function or class, since anywhere else it copies or
# rewrites the attributes of whatever it is handed: (its name, what it may decorate, whether it takes exactly
# one argument, why).
DECORATORS_ONLY = {
    functools.wraps: ("functools.wraps", (ast.FunctionDef, ast.AsyncFunctionDef), True,
                      "other than as `@functools.wraps(f)` on its own function: only so does it copy nothing but "
                      "f's name and docstring onto that function"),
    dataclasses.dataclass: ("dataclasses.dataclass", (ast.ClassDef,), False,
                            "other than as a decorator of its own class (`@dataclass class Name: ...`): on another "
                            "class it rewrites that class's methods"),
    # they write onto what they are given (a wrapper over a class's methods, `__final__`, comparison methods): called,
    # the check cannot tell that what they get is the file's own (a class kept in a list is torch's, say)
    torch.compiler.disable: ("torch.compiler.disable", (ast.FunctionDef, ast.AsyncFunctionDef), False,
                             "other than as a decorator of its own function (`@torch.compiler.disable def hook(...)`): "
                             "called on a class, it replaces that class's methods for the whole process"),
    typing.final: ("typing.final", (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef), False,
                   "other than as a decorator of its own function or class: it writes onto what it is given"),
    functools.total_ordering: ("functools.total_ordering", (ast.ClassDef,), False,
                               "other than as a decorator of its own class: it writes methods onto what it is given"),
    abc.abstractmethod: ("abc.abstractmethod", (ast.FunctionDef, ast.AsyncFunctionDef), False,
                         "other than as a decorator of its own method: it writes onto what it is given"),
    typing.runtime_checkable: ("typing.runtime_checkable", (ast.ClassDef,), False,
                               "other than as a decorator of its own class: it writes onto what it is given"),
    torch.utils.hooks.unserializable_hook: ("torch.utils.hooks.unserializable_hook",
                                            (ast.FunctionDef, ast.AsyncFunctionDef), False,
                                            "other than as a decorator of its own function: it writes onto what it is "
                                            "given"),
}


def _mutable_class(value) -> bool:
    """A class whose attributes can be written (Python's and pybind's; not a builtin like int or dict)."""
    return isinstance(value, type) and not value.__flags__ & (1 << 8)  # Py_TPFLAGS_IMMUTABLETYPE


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


@dataclass(frozen=True)
class _Names:
    api: frozenset[str]         # the allowed API: public names of the allowed modules and their classes
    modules: dict[str, str]     # attribute name -> the module it reaches, outside the allowed ones
    frames: frozenset[str]      # attributes of frames, code, tracebacks, generators, cells
    introspected: frozenset[str]  # every name found in the allowed modules and their classes
    searched: frozenset[str]    # the modules whose attributes were searched for modules

    def submodules(self) -> dict[str, str]:
        """The submodules of the searched modules, by the attribute name that reaches them: those on disk, imported or
        not (torch._dynamo, which torch imports when the attribute is first read; the check reads the same names
        whatever the checking process imported), and those imported since from elsewhere."""
        allowed = SUBMODULE_ATTRS | SHADOWED_MODULE_ATTRS
        imported = {name: full for full in list(sys.modules) if "." in full
                    for parent, name in [full.rsplit(".", 1)] if parent in self.searched and name not in allowed}
        return {**_on_disk(self.searched, self.api), **imported}


@functools.cache
def _on_disk(searched: frozenset[str], api: frozenset[str]) -> dict[str, str]:
    """name -> module of every submodule in the folders of the searched packages that import a submodule when its
    attribute is first read (a module `__getattr__`: torch's), listed, never imported; but those reached by an allowed
    attribute and those named as the API. Elsewhere a submodule not yet imported is no attribute to read."""
    import pkgutil

    allowed = SUBMODULE_ATTRS | SHADOWED_MODULE_ATTRS | api
    return {info.name: f"{parent}.{info.name}" for parent in sorted(searched)
            if (module := sys.modules.get(parent)) is not None and "__getattr__" in vars(module)
            and (path := getattr(module, "__path__", None)) is not None
            for info in pkgutil.iter_modules(path) if info.name not in allowed}


@functools.cache
def _names() -> _Names:
    """Introspected from the installed torch and Python, once per process."""
    with warnings.catch_warnings():  # reading deprecated attributes (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        return _introspect()


def _introspect() -> _Names:
    module_names: dict[str, str] = {}
    seen: set[str] = set()
    hidden: set[str] = set()
    classes: list[type] = [list, dict, set, frozenset, tuple, str, bytes, int, float, complex, bool, range, slice,
                           object, BaseException, memoryview, type(print), types.FunctionType,
                           types.MethodType, type(torch.autograd.Variable._execution_engine)]
    # (module, whether its names are API): the allowed modules, then what shadowed names reach.
    queue = [(importlib.import_module(m), True) for m in sorted(ALLOWED_IMPORTS - {"__future__", "os"})]
    searched = {id(m) for m, _ in queue}
    parents = {m.__name__ for m, _ in queue}
    while queue:
        holder, api = queue.pop()
        for name in dir(holder):
            try:
                value = getattr(holder, name)
            except Exception:  # a lazy attribute that fails to load: nothing reaches it either
                continue
            if isinstance(value, types.ModuleType):
                if value.__name__ in ALLOWED_IMPORTS:
                    continue
                if name in SHADOWED_MODULE_ATTRS | SUBMODULE_ATTRS:
                    if id(value) not in searched:
                        searched.add(id(value))
                        parents.add(value.__name__)
                        queue.append((value, False))
                else:
                    module_names.setdefault(name, value.__name__)
            elif api:
                seen.add(name)
                if isinstance(value, type):
                    classes.append(value)
            else:  # a name of a module a shadowed attribute reaches (torch.storage): not API, never the file's own
                hidden.add(name)
    for cls in classes:
        # Instance attributes a class declares (nn.Linear's weight and in_features, Shard's dim).
        for declared in (vars(cls).get("__annotations__"), vars(cls).get("__constants__")):
            if isinstance(declared, (dict, list, tuple)):
                seen.update(n for n in declared if isinstance(n, str))
        for name in dir(cls):
            seen.add(name)
            value = getattr(cls, name, None)
            if isinstance(value, types.ModuleType) and value.__name__ not in ALLOWED_IMPORTS \
                    and name not in SHADOWED_MODULE_ATTRS:
                module_names.setdefault(name, value.__name__)
    # What the standard helpers set on their objects in __init__ (a weak container's pending removals, which its
    # iteration guard looks up with `==` wherever a suspended iterator of it is closed): Python's own internals,
    # never a name the file's own declaration makes usable on them
    for helper in (weakref.WeakKeyDictionary, weakref.WeakSet, weakref.WeakValueDictionary, contextlib.ExitStack):
        seen.update(vars(helper()))
    for name in ("os", "sys", "builtins", "importlib", "inspect", "gc", "ctypes", "subprocess", "pickle",
                 "marshal", "types", "io", "shutil", "socket", "pathlib", "runpy", "code", "codeop", "copyreg"):
        module_names.setdefault(name, name)
    for name in SUBMODULE_ATTRS | SHADOWED_MODULE_ATTRS:
        module_names.pop(name, None)
    frames = {n for t in (types.FrameType, types.CodeType, types.TracebackType, types.GeneratorType,
                          types.CoroutineType, types.AsyncGeneratorType, types.CellType)
              for n in dir(t) if n.startswith(("f_", "co_", "tb_", "gi_", "cr_", "ag_", "cell_"))}
    refused = FORBIDDEN_NAMES | frames | set(module_names)
    api = {n for n in seen if not n.startswith("_")} | PRIVATE_ATTRS | SUBMODULE_ATTRS | SHADOWED_MODULE_ATTRS
    return _Names(frozenset(api - refused), module_names, frozenset(frames), frozenset(seen | hidden),
                  frozenset(parents))


def static_problem(path: Path) -> str | None:
    """Why the file at `path` is not a hand-written FSDP, or None. FSDP2 itself is a plain str;
    any other refused construct an `Outside`, naming the line and what to write instead."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except SyntaxError:
        return None  # importing it reports the syntax error where it is
    return _Check(Path(path).name, tree).problem()


class _Check:
    """One file: its imports first (they say what each imported name is), then the names it
    defines, then every node against the allowlist."""

    def __init__(self, filename: str, tree: ast.Module):
        self.filename, self.tree = filename, tree
        self.names = _names()
        self.modules = {**self.names.submodules(), **self.names.modules}
        self.parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.imported: dict[str, object] = {}  # name bound by an import -> what it binds
        self.module_aliases: set[str] = set()  # those bound to a module
        self.dotted_imports: set[str] = set()  # `import torch.utils.hooks`: the module reached by its path
        self.import_values: dict[str, list] = {}  # name -> what each import of it binds
        self.own: set[str] = set()  # names the file defines: functions, classes, arguments, attributes
        self.own_classes: set[str] = set()  # the classes it defines
        self.own_methods: set[str] = set()  # the plain methods they define
        self.class_args: set[str] = set()  # the names their classmethods give their class (cls)
        self.own_functions: set[str] = set()  # the functions it defines outside classes
        self.foreign: set[str] = set()  # its variables bound to classes, modules or functions of torch or Python
        self.class_vars: set[str] = set()  # those bound to the class of an object (`cls = type(x)`)
        self.own_enums: set[str] = set()  # its classes that are enums (derive from enum's, or from its own enums)

    def where(self, node: ast.AST) -> str:
        return f"{self.filename}:{getattr(node, 'lineno', '?')}"

    def problem(self) -> str | None:
        """The file's first problem in reading order (an import's, or any other line's above it)."""
        imports = sorted((n for n in ast.walk(self.tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                         key=_position)
        refused = next(((node, p) for node in imports if (p := self.import_problem(node))), None)
        self.collect_own_names()
        self.bindings = bindings = _bindings(self.tree)
        self.bound = set(bindings)  # every name the file binds (a builtin class's name rebound too)
        self.rebound = {name for name, nodes in bindings.items()  # bound by more than a def (a local of that name)
                        if any(not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Global,
                                                  ast.Nonlocal)) for n in nodes)}
        self.lookup_problems = {id(node): self.given_lookup_problem(node) for node in ast.walk(self.tree)
                                if isinstance(node, ast.FunctionDef) and node.name == GIVEN_LOOKUP_NAME}
        # In the order of the source, an inner expression before the one around it: `torch.os.system`
        # is refused for `.os`, the module it reaches, not for `.system`.
        for node in sorted(ast.walk(self.tree), key=_position):
            if refused and _position(node) >= _position(refused[0]):
                break
            if problem := self.node_problem(node):
                return problem
        return refused[1] if refused else None

    # ------------------------------------------------------------------------------ imports

    def import_problem(self, node: ast.Import | ast.ImportFrom) -> str | None:
        where = self.where(node)
        if isinstance(node, ast.ImportFrom) and node.level:
            return Outside(f"{where} imports from its own package: an FSDP needs only torch and the standard "
                           "helpers; remove the import")
        for mod in [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]:
            if mod.startswith(_FSDP_MODULES):
                return f"{where} imports {mod}"
            if bad := next((part for part in mod.split(".") if part in _IMPORT_PARTS), None):
                return _refuse(f"{where} imports {mod}", bad)
            if mod not in ALLOWED_IMPORTS:
                return Outside(f"{where} imports {mod}: an FSDP needs only {', '.join(sorted(TORCH_IMPORTS))} and "
                               f"{', '.join(sorted(STDLIB_IMPORTS - {'__future__'}))}; remove the import")
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.name if a.asname else a.name.split(".")[0]
                self.imported[a.asname or bound] = importlib.import_module(bound)
                self.import_values.setdefault(a.asname or bound, []).append(self.imported[a.asname or bound])
                if not a.asname:
                    self.dotted_imports.add(a.name)
                self.module_aliases.add(a.asname or bound)
            return None
        if node.module == "__future__":
            return None
        module = importlib.import_module(node.module)
        for a in node.names:
            if a.name == "*":
                return Outside(f"{where} imports * from {node.module}: name what you import")
            if node.module in MODULE_ATTRS and a.name not in (only := MODULE_ATTRS[node.module])[0]:
                return Outside(f"{where} imports {node.module}.{a.name}: of {node.module} an FSDP may use only "
                               f"{', '.join(sorted(only[0]))} ({only[1]})")
            if bad := next((n for n in (a.name, a.asname) if n in FORBIDDEN_NAMES), None):
                return _refuse(f"{where} imports `{bad}`", bad)
            value = getattr(module, a.name, None)
            if isinstance(value, types.ModuleType):
                if value.__name__.startswith(_FSDP_MODULES):
                    return f"{where} imports {value.__name__}"
                if value.__name__ not in ALLOWED_IMPORTS:
                    return Outside(f"{where} imports the module {value.__name__}: an FSDP needs only "
                                   f"{', '.join(sorted(TORCH_IMPORTS))}; remove the import")
                self.module_aliases.add(a.asname or a.name)
            elif node.module not in MODULE_ATTRS and (problem := self.attribute_problem(a.name, node, imported=True)):
                return problem
            if value is dataclasses.dataclass and node.module != "dataclasses":
                return self.dataclass_elsewhere(node, f"from {node.module} import {a.name}")
            self.imported[a.asname or a.name] = value
            self.import_values.setdefault(a.asname or a.name, []).append(value)
        return None

    # ------------------------------------------------------------------------------ the file's own names

    def collect_own_names(self) -> None:
        # The file's classes, and the names of the plain methods (neither static nor class methods) any of
        # them defines: read from a class (`Cls.method`), such a method takes any object as its self.
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                self.own_classes.add(node.name)
                self.own_methods.update(
                    f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not _decorated(f, "staticmethod", "classmethod"))
                self.own_methods.update(t.id for a in node.body if isinstance(a, ast.Assign)
                                        and isinstance(a.value, ast.Lambda) for t in a.targets if isinstance(t, ast.Name))
                self.class_args.update(f.args.args[0].arg for f in node.body if isinstance(f, ast.FunctionDef)
                                       and _decorated(f, "classmethod") and f.args.args)
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.own.add(node.name)
                if not isinstance(node, ast.ClassDef) and not isinstance(self.parents.get(id(node)), ast.ClassDef):
                    self.own_functions.add(node.name)
            elif isinstance(node, ast.arg):
                self.own.add(node.arg)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                self.own.add(node.id)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
                self.own.add(node.attr)
            elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                self.own.add(node.name)
        self.own -= set(self.imported)
        classes = [n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]
        grew = True
        while grew:
            before = len(self.own_enums)
            for node in classes:
                for base in node.bases:
                    value = self.resolve(base)
                    if isinstance(value, type) and issubclass(value, enum.Enum) or \
                            isinstance(base, ast.Name) and base.id in self.own_enums:
                        self.own_enums.add(node.name)
            grew = len(self.own_enums) > before
        # Variables bound to a class, module or function of torch's or Python's (`T = torch.Tensor`,
        # `cls = type(x)`): writing attributes through them would change torch or Python itself.
        for node in ast.walk(self.tree):
            targets, value = [], None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets, value = [node.target], node.value
            if value is not None and self.foreign_value(value):
                self.foreign.update(t.id for t in targets if isinstance(t, ast.Name))
            if value is not None and self.class_of_something(value):
                self.class_vars.update(t.id for t in targets if isinstance(t, ast.Name))

    def resolve(self, node: ast.AST):
        """What an attribute chain rooted at an imported name is (None if it is not one)."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in self.imported):
            return None
        value = self.imported[node.id]
        for attr in reversed(chain):  # statically: reading the file runs no lazy import of torch's
            value = inspect.getattr_static(value, attr, None)
        return value

    def foreign_value(self, node: ast.AST) -> bool:
        """`node` may be a class, module or function of torch's or Python's, not an instance."""
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 1
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.foreign:
            return True
        value = self.resolve(node)
        return isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, list, dict,
                                  set, bytearray)) \
            or (value is None and isinstance(root, ast.Name) and root.id in self.imported)

    def write_problem(self, target: ast.AST, what: str) -> str | None:
        """Writing through `target` would change torch's or Python's own objects."""
        root = target
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in self.imported or root.id in self.foreign) \
                or isinstance(root, ast.Call) and self.foreign_value(root):
            return Outside(f"{self.where(target)} {what} `{ast.unparse(target)}`, which belongs to torch or Python: "
                           "a hand-written FSDP changes its own objects and the modules it wraps, never the "
                           "libraries the grader runs too; keep what you need on your own classes")
        return None

    # ------------------------------------------------------------------------------ the given lookup

    def given_lookup(self, node: ast.AST) -> ast.FunctionDef | None:
        """The register_fsdp_forward_method that `node` lies in, if any."""
        while (node := self.parents.get(id(node))) is not None:
            if isinstance(node, ast.FunctionDef) and node.name == GIVEN_LOOKUP_NAME:
                return node
        return None

    def given_lookup_problem(self, func: ast.FunctionDef) -> str | None:
        """Why this register_fsdp_forward_method may not look a method up by its run-time name
        ([Note: the one lookup by a run-time name]), or None."""
        if func not in self.tree.body:
            return "define it at the top level of the file"
        if _shape(func) != _shape(ast.parse(GIVEN_LOOKUP).body[0]):
            return "its code differs from the skeleton's; copy it back unchanged"
        bindings = self.bindings
        for name in GIVEN_LOOKUP_BUILTINS:
            if name in bindings:
                return f"line {bindings[name][0].lineno} binds `{name}`, which it calls; rename that"
        canonical = {"functools": ("import functools", lambda n: isinstance(n, ast.alias) and n.name == "functools"
                                   and n.asname is None and isinstance(self.parents.get(id(n)), ast.Import)),
                     "nn": ("from torch import nn", lambda n: isinstance(n, ast.alias) and n.name == "nn"
                            and n.asname is None and isinstance(imp := self.parents.get(id(n)), ast.ImportFrom)
                            and imp.module == "torch" and not imp.level),
                     "FSDPModule": ("class FSDPModule: (no base, keyword or decorator)", lambda n: isinstance(
                         n, ast.ClassDef) and not (n.bases or n.keywords or n.decorator_list))}
        for name, (wanted, is_canonical) in canonical.items():
            sites = bindings.get(name, [])
            top = [n for n in sites if is_canonical(n) and (n in self.tree.body or self.parents.get(id(n)) in self.tree.body)]
            if len(sites) != 1 or len(top) != 1:
                where = next((n for n in sites if n not in top), None)
                return (f"line {where.lineno} binds `{name}` again" if where is not None and top else
                        f"`{name}` must be bound once, by `{wanted}` at the top of the file"
                        + (f" (line {where.lineno} binds it otherwise)" if where is not None else ""))
        return None

    # ------------------------------------------------------------------------------ every node

    def on_imported_path(self, node: ast.AST) -> bool:
        """`node` is a module the file imported by its path (`import torch.utils.hooks`, then torch.utils.hooks.X), or a
        step on that path to it (torch.utils, only as in torch.utils.hooks)."""
        def dotted(n) -> str | None:
            parts = []
            while isinstance(n, ast.Attribute):
                parts.append(n.attr)
                n = n.value
            return ".".join([n.id, *reversed(parts)]) if isinstance(n, ast.Name) and n.id in self.imported and all(
                isinstance(b, ast.alias) for b in self.bindings.get(n.id, ())) else None  # bound by imports only
        parent = self.parents.get(id(node))
        return isinstance(node, ast.Attribute) and (dotted(node) in self.dotted_imports or isinstance(
            parent, ast.Attribute) and (path := dotted(parent)) is not None and any(
            i == path or i.startswith(path + ".") for i in self.dotted_imports))

    def attribute_problem(self, name: str, node: ast.AST, imported: bool = False, base=None) -> str | None:
        """`name` read or written as an attribute (of `base`, where known) or imported from a module
        is not allowed."""
        where = self.where(node)
        if name == "__class__" and not isinstance(node, ast.Attribute):  # the loader guards `x.__class__` only
            return Outside(f"{where} reads `__class__` by a name or a pattern (getattr, case C(__class__=...)): write "
                           "x.__class__ or type(x)")
        if name in _FSDP2_NAMES:
            return f"{where} uses `{name}`: {ADVICE[name]}"
        if name in PICKLING_HOOKS:
            return Outside(f"{where} uses `{name}`: {_PICKLE_ADVICE}")
        if name in STORAGE_GETTERS and not isinstance(node, ast.Attribute):
            return Outside(f"{where} takes `{name}` by a name or a pattern: write x.untyped_storage() and call "
                           f"{_STORAGE_USES} on it (harness/tools/grading/handwritten.py, [Note: a storage's bytes])")
        if name in ("format", "format_map") and not imported:
            return self.format_problem(node)
        if name in FORBIDDEN_NAMES:
            if isinstance(node, ast.arg) or isinstance(getattr(node, "ctx", None), ast.Store):
                return Outside(f"{where} names its own `{name}`, a name of torch's or Python's that the check "
                               f"refuses: name it otherwise (`{name}_`)")
            return _refuse(f"{where} uses `{name}`", name)
        if name.startswith(("_raw_saved_", "_saved_")):  # a backward node's saved tensors, and their hooks
            return Outside(f"{where} uses `.{name}`, a backward node's saved tensor: an FSDP never needs them; "
                           "they run inside the model's backward, where the overlap check counts only the model's "
                           "compute")
        if _dunder(name):
            if name == "__call__" and isinstance(node, ast.Attribute) and not self.super_called(node):
                # `enum.Enum.__call__` is enum.Enum, past every rule that reads which class is called
                return Outside(f"{where} uses `.__call__`: call the object itself (obj(...), or super().__call__(...) "
                               "in a method), so the check reads what is called")
            if name in ("__enter__", "__exit__") and isinstance(node, ast.Attribute):
                # (defined in a class of the file's, as a method's name: fine) read off an object, it is a context
                # entered or left by hand: a generator's context held open, and closed wherever torch frees it
                return Outside(f"{where} uses `{ast.unparse(node)}`: enter a context with a `with` statement, which "
                               "also leaves it (a context entered by hand may stay on, and be left wherever Python "
                               "frees it)")
            if name in ALLOWED_DUNDERS:
                return None
            if name in ("__setattr__", "__delattr__"):
                return Outside(f"{where} uses `{name}`, which writes past the loader's guard of attribute writes: write "
                               "obj.name = value (a frozen dataclass is set in its __init__ only: drop frozen=True to "
                               "set its fields later)")
            return Outside(f"{where} uses `{name}`: it reaches modules, globals or code objects, which a "
                           "hand-written FSDP does not need; " + _ARGS)
        if name in INTERNAL_ATTRS:  # on `self` too: a method of the file's may be called with any object as self
            return Outside(f"{where} uses `.{name}`, an attribute of a standard helper's internals (a context "
                           "manager's generator, warnings' module or filters, logging's manager, a logger's filters and "
                           "handlers, a hook handle's table): name your own attribute otherwise")
        if name in self.names.frames:
            return Outside(f"{where} uses `.{name}`, an attribute of frames, code objects or generators' internals, "
                           "which a hand-written FSDP does not need; " + _ARGS)
        if name in self.modules:
            if self.on_imported_path(node):
                return None
            module = inspect.getattr_static(base, name, None) if base is not None else None
            module = module.__name__ if isinstance(module, types.ModuleType) else self.modules[name]
            return Outside(f"{where} uses `.{name}`, which is the module {module} there: an FSDP "
                           f"reaches no module but those it imports; {_COMPUTED} (and name your own attributes "
                           "otherwise)")
        # The file's own names are its objects' attributes: never those of a module, class or function that
        # torch or Python gave it (`base`, where the check can tell), whatever that object's name set holds.
        if name in self.names.api or (name in self.own and not imported and base is None
                                      and name not in self.names.introspected):
            return None
        if name in self.names.introspected:
            return Outside(f"{where} uses `.{name}`, which is private to torch or Python: {_PUBLIC_API}, "
                           "or name your own attribute otherwise")
        return Outside(f"{where} uses `.{name}`, which is neither the API of torch and the standard helpers nor a "
                       f"name this file defines: {_PUBLIC_API}")

    def storage_problem(self, node: ast.Attribute) -> str | None:
        """`x.untyped_storage()` only to free, re-allocate or locate the memory (see [Note: a storage's bytes])."""
        where = self.where(node)
        call = self.parents.get(id(node))
        note = "(harness/tools/grading/handwritten.py, [Note: a storage's bytes])"
        if node.attr == "storage":
            if isinstance(call, ast.Call) and call.func is node:
                return Outside(f"{where} calls `{ast.unparse(node)}()`, a typed storage: use x.untyped_storage() and "
                               f"call {_STORAGE_USES} on it {note}")
            if isinstance(self.resolve(node), types.ModuleType):
                return None  # the module torch.storage (refused as a module)
            return Outside(f"{where} takes `{ast.unparse(node)}`, a tensor's typed storage: use x.untyped_storage() and "
                           f"call {_STORAGE_USES} on it (and name your own attribute otherwise) {note}")
        if not (isinstance(call, ast.Call) and call.func is node):
            return Outside(f"{where} takes `{ast.unparse(node)}` without calling it: write x.untyped_storage() and call "
                           f"{_STORAGE_USES} on it {note}")
        if self.storage_used(call):
            return None
        return Outside(f"{where} uses `{ast.unparse(call)}` other than by calling {_STORAGE_USES} on it (resize_ as a "
                       f"statement of its own, the storage in place or in a local name used only so): {note}")

    def storage_used(self, expr: ast.expr) -> bool:
        """A storage used only as the receiver of STORAGE_USES: in place, or bound to a function's local name
        (`s = x.untyped_storage()`, `(s := x.untyped_storage()).size()`) that the file reads nowhere else and
        declares global or nonlocal nowhere."""
        parent = self.parents.get(id(expr))
        if isinstance(parent, ast.NamedExpr) and parent.value is expr:
            return self.storage_used(parent) and self.storage_name_used(parent.target.id, parent)
        if isinstance(parent, ast.Assign) and parent.value is expr and len(parent.targets) == 1 \
                and isinstance(parent.targets[0], ast.Name):
            return self.storage_name_used(parent.targets[0].id, parent)
        return self.storage_receiver(expr)

    def storage_receiver(self, expr: ast.expr) -> bool:
        """`expr.<one of STORAGE_USES>(...)`; resize_ (which returns the storage) as a statement of its own."""
        parent = self.parents.get(id(expr))
        return isinstance(parent, ast.Attribute) and parent.value is expr and parent.attr in STORAGE_USES \
            and isinstance(call := self.parents.get(id(parent)), ast.Call) and call.func is parent \
            and (parent.attr != "resize_" or isinstance(self.parents.get(id(call)), ast.Expr))

    def storage_name_used(self, name: str, binding: ast.AST) -> bool:
        scope = self.parents.get(id(binding))
        while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                           ast.Lambda, ast.Module)):
            scope = self.parents.get(id(scope))
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False  # a module's or a class's name is an attribute anyone may read
        nodes = list(ast.walk(self.tree))
        return not any(isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names for n in nodes) and \
            all(self.storage_receiver(n) for n in nodes if isinstance(n, ast.Name) and n.id == name
                and isinstance(n.ctx, ast.Load))

    def format_problem(self, node: ast.AST) -> str | None:
        """str.format reads the attributes and items its fields name (`{0.__globals__}`): only a
        literal string with plain fields, called in place, may be formatted."""
        where = self.where(node)
        advice = "use an f-string, whose fields are code the check reads, or plain fields ({} {0} {name})"
        value = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(node, ast.Attribute) and node.attr == "format_map" \
                or not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
            return Outside(f"{where} formats a string it does not show: str.format reads the attributes its fields "
                           f"name; {advice}")

        def fields(text: str, depth: int = 0):
            for _, field, spec, _ in string.Formatter().parse(text):
                if field is not None:
                    yield field
                if spec and depth < 3:
                    yield from fields(spec, depth + 1)

        try:
            bad = next((f for f in fields(value.value) if not (f == "" or f.isdigit() or f.isidentifier())), None)
        except ValueError:  # not a valid format string: it would fail when run
            bad = None
        if bad is not None:
            return Outside(f"{where} formats the field {{{bad}}}: str.format reads the attributes and items its "
                           f"fields name; {advice}")
        return None

    def named_write_problem(self, node: ast.AST, name: str, target: ast.AST) -> str | None:
        """Writing attribute `name` of `target` (`x.name = ...`, `setattr(x, "name", ...)`) where `target` may be
        torch's, under whatever alias it was reached (a list item, a loop variable, a parameter, `type(t)`)."""
        if self.on_own_instance(node, target):
            return None
        if name in _torch_callables():
            return Outside(f"{self.where(node)} writes over `.{name}`, the name of a torch function or method: an "
                           "FSDP calls torch and changes none of it; store your own values under names of your own")
        if _dunder(name) and name != "__class__":  # __class__: how fully_shard gives a module its FSDP class
            return Outside(f"{self.where(node)} writes `.{name}`, a hook Python calls on its own, on an object that may "
                           "be torch's: a hand-written FSDP defines such methods only in its own classes")
        return None

    def a_class(self, node: ast.AST) -> bool:
        """`node` is one of the file's classes or may be: its name, `x.__class__`, `type(x)`, a classmethod's cls."""
        return isinstance(node, ast.Name) and (node.id in self.own_classes or node.id in self.class_args) \
            or isinstance(node, ast.Attribute) and node.attr == "__class__" \
            or isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"

    def on_own_instance(self, node: ast.AST, value: ast.AST | None = None) -> bool:
        """Whether `node` writes an attribute of `self` (`value`, by default `node.value`) in a plain method of
        one of the file's classes (the method's first argument, never rebound in it): the file's own
        instance, whose names are its own."""
        func = self.parents.get(id(node))
        while func is not None and not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            func = self.parents.get(id(func))
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                not isinstance(self.parents.get(id(func)), ast.ClassDef) or not func.args.args \
                or _decorated(func, "staticmethod", "classmethod"):
            return False
        me = func.args.args[0].arg
        rebound = any(isinstance(n, ast.Name) and n.id == me and not isinstance(n.ctx, ast.Load)
                      for n in ast.walk(func)) or any(isinstance(n, (ast.Global, ast.Nonlocal)) and me in n.names
                                                      for n in ast.walk(func))
        value = node.value if value is None else value
        return isinstance(value, ast.Name) and value.id == me and not rebound

    @staticmethod
    def held_context(func: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST | None:
        """A yield of `func` itself (not of a function inside it) inside one of its `with` blocks."""
        def walk(node: ast.AST, inside: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    continue
                if isinstance(child, (ast.Yield, ast.YieldFrom, ast.Await)) and inside:
                    return child
                found = walk(child, inside or isinstance(child, (ast.With, ast.AsyncWith)))
                if found is not None:
                    return found
            return None

        return walk(func, False)

    @staticmethod
    def class_of_something(node: ast.AST) -> bool:
        """`node` is `type(x)` or `x.__class__`: a class."""
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" or \
            isinstance(node, ast.Attribute) and node.attr == "__class__"

    def type_argument_problem(self, node: ast.Call) -> str | None:
        """The class of an object (`type(x)`, `x.__class__`) handed to torch's or Python's code, which may write
        onto what it is given (torch.compiler.disable(cls) replaces its methods): only read it in place."""
        func = node.func.id if isinstance(node.func, ast.Name) else None
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        if isinstance(receiver, ast.Name) and node.func.attr in READING_METHODS and receiver.id not in self.foreign \
                and receiver.id not in self.imported and receiver.id not in self.module_aliases:
            return None  # a class kept in, or said by, the file's own dict, set, list or logger
        if func in ("isinstance", "issubclass", "type", "id", "hash", "repr", "str", "print") or \
                func in self.own_functions and func not in self.rebound:
            return None  # the file's own functions (a name bound only by their def): call_problem's rule
        for arg in (given := _given(node)):
            if self.class_of_something(arg) or isinstance(arg, ast.Name) and arg.id in self.class_vars:
                return Outside(f"{self.where(node)} hands `{ast.unparse(arg)}`, a class, to `{ast.unparse(node.func)}`, "
                               "which may change it for the whole process: read a class in place (type(x).__name__, "
                               "isinstance(x, C)), and hand torch your own objects")
        return None

    def base_problem(self, node: ast.ClassDef, base: ast.expr) -> str | None:
        """A class of the file derives from its own classes, or from what an FSDP builds on (ALLOWED_BASES):
        a base of torch's or Python's otherwise brings methods that act on the file's attributes in ways the
        check cannot see (a dataclasses.Field's name becomes code; a metaclass's methods get torch's classes as
        self)."""
        target = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
        if isinstance(target, ast.Name) and target.id in self.own_classes:
            return None
        value = self.resolve(target)
        if value is None and isinstance(target, ast.Name) and target.id in _SAFE_BUILTIN_BASES:
            return None
        if value is None and isinstance(target, ast.Name) and target.id in ENUM_MIXINS and any(
                isinstance(b, type) and issubclass(b, enum.Enum) for b in map(self.resolve, node.bases)):
            return None  # an enum's mixin (enum_problem reads the rest)
        if any(value is b for b in ALLOWED_BASES) or isinstance(value, type) and issubclass(value, SUBCLASSED_BASES):
            return None
        return Outside(f"{self.where(node)} derives {node.name} from `{ast.unparse(base)}`: a hand-written FSDP's classes "
                       "derive from its own, object, an exception, enum.Enum, torch.nn.Module or "
                       "torch.autograd.Function")

    def class_in_place(self, node: ast.expr) -> bool:
        """`node` (one of torch's or Python's classes) is used where it stands: called, an attribute read from
        it, in isinstance/issubclass, a base, an except clause, a comparison, an annotation, a generic's
        argument or a decorator; not stored, passed or put in a container under another name."""
        holder, parent = node, self.parents.get(id(node))
        if isinstance(parent, ast.Tuple):
            holder, parent = parent, self.parents.get(id(parent))
        if holder is node and (isinstance(parent, ast.Attribute) and parent.value is node
                               or isinstance(parent, ast.Call) and parent.func is node):
            return True
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and \
                parent.func.id in ("isinstance", "issubclass") and parent.args[1:2] == [holder]:
            return True
        if isinstance(parent, ast.ClassDef) and holder in parent.bases or \
                isinstance(parent, ast.ExceptHandler) and parent.type is holder or isinstance(parent, ast.Compare) or \
                isinstance(parent, ast.Subscript) and parent.slice is holder or \
                isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and holder in parent.decorator_list:
            return True
        child = node
        while (parent := self.parents.get(id(child))) is not None:  # an annotation, however deep in it
            if isinstance(parent, ast.arg) and parent.annotation is child or isinstance(parent, ast.AnnAssign) and \
                    parent.annotation is child or isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    parent.returns is child:
                return True
            if isinstance(parent, ast.stmt):
                return False
            child = parent
        return False

    def super_called(self, node: ast.Attribute) -> bool:
        """`super().name(...)`: the method of the file's own class's bases (checked bases), called in place."""
        call = self.parents.get(id(node))
        return isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and \
            node.value.func.id == "super" and not node.value.args and isinstance(call, ast.Call) and call.func is node

    def slots_problem(self, value: ast.expr) -> str | None:
        """`__slots__` written out: a string, or a tuple or list of them (the loader refuses a slot named as a dunder
        but __weakref__ and __dict__: it would stand in for what Python does under that name)."""
        items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
        if all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            return None
        return Outside(f"{self.where(value)} gives `__slots__` as `{ast.unparse(value)}`: write the slots out as a tuple "
                       "of names, so the check can read them")

    def in_slots(self, node: ast.AST) -> bool:
        """`node` is the value, or an item of the literal value, of a class body's `__slots__ = ...` or of the
        `"__slots__"` key of type()'s namespace."""
        value, parent = node, self.parents.get(id(node))
        if isinstance(parent, (ast.Tuple, ast.List, ast.Set)):
            value, parent = parent, self.parents.get(id(parent))
        if isinstance(parent, ast.Dict):
            return any(v is value and isinstance(k, ast.Constant) and k.value == "__slots__"
                       for k, v in zip(parent.keys, parent.values))
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target] if isinstance(
            parent, ast.AnnAssign) else []
        return isinstance(self.parents.get(id(parent)), ast.ClassDef) and [ast.unparse(t) for t in targets] == [
            "__slots__"]

    def container_problem(self, node: ast.Call) -> str | None:
        """A list, dict or set of torch's or Python's (reached by name) changed in place by its own methods."""
        if isinstance(node.func, ast.Attribute) and node.func.attr in CONTAINER_MUTATORS and \
                isinstance(self.resolve(node.func.value), (list, dict, set, bytearray)):
            return Outside(f"{self.where(node)} changes `{ast.unparse(node.func.value)}`, which belongs to torch or "
                           "Python: an FSDP changes its own containers only")
        return None

    def decorator_problem(self, node: ast.expr, value) -> str | None:
        """`node` (one of DECORATORS_ONLY) is used as a decorator of the file's own function or class, and
        nothing else."""
        name, defs, one_argument, advice = DECORATORS_ONLY[value]
        parent = self.parents.get(id(node))
        call = parent if isinstance(parent, ast.Call) and parent.func is node else None
        if one_argument and call is None:
            return Outside(f"{self.where(node)} passes {name} around: use it as `@{name}(f)` on your own function")
        decorator = call or node
        owner = self.parents.get(id(decorator))
        if not (isinstance(owner, defs) and decorator in owner.decorator_list) or one_argument and (
                len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred)):
            return Outside(f"{self.where(node)} uses {name} {advice}")
        return None

    def dataclass_elsewhere(self, node: ast.AST, written: str) -> str:
        return Outside(f"{self.where(node)} reaches dataclasses.dataclass as `{written}`: take it from dataclasses "
                       "(`from dataclasses import dataclass`, or dataclasses.dataclass), whose dataclass the loader "
                       "checks")

    def rebinds(self, node: ast.AST, name: str) -> str:
        return Outside(f"{self.where(node)} binds the name `{name}`, the builtin the check and the loader watch: "
                       "name yours otherwise")

    def node_problem(self, node: ast.AST) -> str | None:
        where = self.where(node)
        if isinstance(node, ast.Name) and node.id == "__module__" and not isinstance(node.ctx, ast.Load) or \
                isinstance(node, ast.Attribute) and node.attr == "__module__" and not isinstance(node.ctx, ast.Load):
            return Outside(f"{where} sets `__module__`: a class or function of the file belongs to the file "
                           "(enum and others act on the module it names)")
        if isinstance(node, ast.Name) and node.id == "__slots__" and not isinstance(node.ctx, ast.Load):
            parent = self.parents.get(id(node))
            if not (isinstance(parent, ast.Assign) and parent.targets == [node]
                    or isinstance(parent, ast.AnnAssign) and parent.value is not None):
                return Outside(f"{where} binds `__slots__` otherwise than as `__slots__ = (names)`: write it so")
            if problem := self.slots_problem(parent.value):
                return problem
        # Every way a name is bound (an `except ... as` target is deleted again when its block ends, and with it
        # the loader's guard of that name): never one the check trusts to be Python's own.
        for bound in _bound(node):
            if bound in GUARDED_BUILTINS:
                return self.rebinds(node, bound)
            if bound == "__name__":  # what Python gives the `__module__` of the classes made after
                return Outside(f"{where} binds `__name__`: the file's classes take their `__module__` from it, and "
                               "belong to the file (enum and others act on the module it names)")
            # the check reads an imported name as its import: one name, one object, bound by imports only (a
            # function's own import, or a second import further down, would run with another than the one read)
            if bound in self.imported and (not isinstance(node, ast.alias) or
                                           len({id(v) for v in self.import_values.get(bound, ())}) > 1):
                return Outside(f"{where} binds `{bound}`, a name the file imports, to something else too (the check "
                               "reads it as one import): give each its own name")
            if bound == "__class__":
                return Outside(f"{where} defines `__class__` in a class (isinstance believes what it says: an object of "
                               "yours would pass for one of torch's or Python's): read x.__class__, or assign it on an "
                               "object (m.__class__ = C)")
            # the check reads these by name (a safe base, a call that only reads its arguments): bound to anything
            # else, the name would pass for Python's own
            if bound in TRUSTED_BUILTINS:
                return Outside(f"{where} binds the name `{bound}`, a builtin the check trusts by its name (bound to "
                               "anything else it would pass for Python's own): name yours otherwise")
            # the check reads a class of the file by its name (a base): bound to anything else, the name would pass
            # for it
            if bound in self.own_classes and not isinstance(node, (ast.ClassDef, ast.Global, ast.Nonlocal)):
                return Outside(f"{where} binds `{bound}`, the name of a class the file defines, to something else: name "
                               "it otherwise")
            if not isinstance(node, (ast.Name, ast.FunctionDef, ast.AsyncFunctionDef)) and _dunder(bound) \
                    and bound not in ALLOWED_DUNDERS:
                return Outside(f"{where} binds `{bound}`, a name Python and the loader give the file: name yours "
                               "otherwise")
        # An attribute stored as a loop's, a with's or a comprehension's target is written past the loader's guard of
        # attribute writes (which rewrites assignments): a plain name there, the attribute assigned in the body.
        target = node.target if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) else \
            node.optional_vars if isinstance(node, ast.withitem) else None
        if stored := stored_attribute(target):
            return Outside(f"{self.where(stored)} stores into `{ast.unparse(stored)}` as the target of a for, a with or "
                           "a comprehension: bind a plain name there and assign the attribute in the body")
        # What a name or attribute chain read here is (resolved once for the rules below; None if not torch's or
        # Python's).
        value = self.resolve(node) if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load) \
            else None
        # torch's and Python's mutable classes (not int, dict, Exception...: their attributes cannot be written)
        # only in place: under another name (a list item, a loop variable, an argument) the check cannot see
        # what is written on them or done to them
        if _mutable_class(value) and not self.class_in_place(node):
            return Outside(f"{where} passes the class {value.__module__}.{value.__qualname__} around "
                           f"(`{ast.unparse(self.parents.get(id(node)))}`): use torch's classes in place "
                           "(isinstance(x, torch.Tensor), torch.Tensor(...), torch.Tensor.method), so the check can "
                           "read what is done with them")
        # torch's and Python's containers (a list, a dict, a set reached by name) only read in place: under another
        # name (a variable, a default argument, an argument) the check cannot see what is written into them
        if isinstance(value, (list, dict, set, bytearray)):
            parent = self.parents.get(id(node))
            if isinstance(parent, ast.Attribute) and parent.attr in CONTAINER_MUTATORS and not (
                    isinstance(call := self.parents.get(id(parent)), ast.Call) and call.func is parent):
                return Outside(f"{where} takes `{ast.unparse(parent)}`, which changes `{ast.unparse(node)}`, a "
                               "container of torch's or Python's: an FSDP changes its own containers only")
            read = isinstance(parent, ast.Attribute) and parent.value is node or \
                isinstance(parent, ast.Subscript) and parent.value is node or isinstance(parent, ast.Compare) or \
                isinstance(parent, (ast.For, ast.comprehension)) and parent.iter is node or \
                isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in READING_BUILTINS
            if not read:
                return Outside(f"{where} passes `{ast.unparse(node)}`, which belongs to torch or Python, around: read it "
                               "in place (len(x), x[k], for v in x); an FSDP changes its own containers only")
        if any(value is d for d in DECORATORS_ONLY) and (problem := self.decorator_problem(node, value)):
            return problem
        if value is not None and any(value is w for w in (enum.member, enum.nonmember)):
            return Outside(f"{where} uses `{ast.unparse(node)}`, which decides what an enum makes a member: an enum's "
                           "body is its members (NAME = value) and methods")
        if isinstance(node, ast.Attribute) and node.attr in ("KW_ONLY", "InitVar") and \
                self.resolve(node.value) is dataclasses:
            return (f"{where} writes `{ast.unparse(node)}`: write `from dataclasses import {node.attr}` and use "
                    f"`{node.attr}` (a file under test gets a checked copy of dataclasses, which dataclass does not "
                    "take for itself in a `dataclasses.` annotation)")
        if value is dataclasses.dataclass and isinstance(node, ast.Attribute) and \
                self.resolve(node.value) is not dataclasses:  # torch.compiler.dataclass: Python's, not the loader's
            return self.dataclass_elsewhere(node, ast.unparse(node))
        # torch's own functions and methods are never the file's to replace, under whatever alias it reached
        # them (a list item, a loop variable, a default argument, `type(t)`): no write to an attribute so named.
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and not self.write_problem(node.value, "writes"):  # that one's own words below
            if problem := self.named_write_problem(node, node.attr, node.value):
                return problem
        # A dunder written as a string or a keyword becomes an attribute where the check cannot see it
        # (type()'s namespace, dict(__getattr__=...), enum's functional API, setattr): only the allowed ones.
        dunder = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else \
            node.arg if isinstance(node, ast.keyword) else None
        if dunder and _dunder(dunder) and dunder not in ALLOWED_METHODS and not (
                dunder in SLOTS_DUNDERS and self.in_slots(node)):
            return Outside(f"{where} names `{dunder}` in a string or keyword: "
                           + (_PICKLE_ADVICE if dunder in PICKLING_HOOKS else
                              "a hook Python calls on its own, which a hand-written FSDP does not need; write a "
                              "plain method and call it"))
        if isinstance(node, (ast.Name, ast.Attribute)) and self.resolve(node) is os.environ:
            parent = self.parents.get(id(node))
            if not (isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node
                    or isinstance(parent, ast.Compare) and node in parent.comparators):
                return Outside(f"{where} passes os.environ around: read it in place (os.environ.get(...), "
                               "os.environ[...]); an FSDP never changes it")
        if isinstance(node, ast.Attribute) and node.attr in STORAGE_GETTERS and isinstance(node.ctx, ast.Load) \
                and (problem := self.storage_problem(node)):
            return problem
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base is os.environ and node.attr not in ENVIRON_ATTRS:
                return Outside(f"{where} uses os.environ.{node.attr}: an FSDP reads settings from os.environ "
                               f"({', '.join(sorted(ENVIRON_ATTRS))}, os.environ[...]) and never changes them")
            if isinstance(base, types.ModuleType) and (only := MODULE_ATTRS.get(base.__name__)) is not None:
                if node.attr not in only[0]:
                    return Outside(f"{where} uses {base.__name__}.{node.attr}: of {base.__name__} an FSDP may use "
                                   f"only {', '.join(sorted(only[0]))} ({only[1]})")
            elif problem := self.attribute_problem(node.attr, node, base=base):
                return problem
            # A module reached as an attribute is used in place (torch.x.y): through another name (a variable,
            # a list, a default argument) its attributes would be unknown to this check.
            if isinstance(node.ctx, ast.Load) and isinstance(module := self.resolve(node), types.ModuleType):
                parent = self.parents.get(id(node))
                if not (isinstance(parent, ast.Attribute) and parent.value is node):
                    return Outside(f"{where} passes the module {module.__name__} around (`{ast.unparse(node)}`): use "
                                   "its members in place (torch.x.y), so the check can read what is used")
            if node.attr == "__class__" and self.class_of_something(node.value):
                return Outside(f"{where} takes `{ast.unparse(node)}`, the class of a class (a metaclass, which makes "
                               "classes from any namespace): write classes out")
            # A plain method read from the file's own class takes whatever its caller passes as self.
            if isinstance(node.ctx, ast.Load) and node.attr in self.own_methods and self.a_class(node.value):
                return Outside(f"{where} takes `{ast.unparse(node)}` from the class, where its first argument is whatever "
                               "the call passes (torch's or Python's objects too): call methods on your instances "
                               "(obj.method(...)), or make it a @staticmethod without self")
            return None if isinstance(node.ctx, ast.Load) else self.write_problem(node, "writes")
        if isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load):
            return self.write_problem(node, "writes into")
        if isinstance(node, ast.Name):
            return self.name_problem(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                not any(self.resolve(d) is contextlib.contextmanager for d in node.decorator_list) and \
                (held := self.held_context(node)) is not None:
            return Outside(f"{self.where(held)} yields inside a `with` block of a generator: the context stays on while "
                           "the generator waits, for the whole process if it is never resumed; leave the block before "
                           "yielding (or make the function a @contextlib.contextmanager, used in a `with`)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _dunder(node.name):
            if node.name in PICKLING_HOOKS:
                return Outside(f"{where} defines `{node.name}`: {_PICKLE_ADVICE}")
            if node.name not in ALLOWED_METHODS:
                return Outside(f"{where} defines `{node.name}`, a hook Python calls on its own (at class creation, "
                               "attribute lookup, garbage collection...), which a hand-written FSDP does not need: "
                               "write a plain method and call it")
            return None
        if isinstance(node, ast.ClassDef):
            for decorator in node.decorator_list:
                if not any(self.resolve(decorator.func if isinstance(decorator, ast.Call) else decorator) is d
                           for d in CLASS_DECORATORS):
                    return Outside(f"{where} decorates {node.name} with `{ast.unparse(decorator)}`, whose result the "
                                   "check cannot know (the name would stand for whatever it returns): decorate classes "
                                   "only with dataclasses.dataclass, functools.total_ordering, enum.unique or "
                                   "typing.final")
            if node.name in self.own_enums and (problem := self.enum_problem(node)):
                return problem
            for kw in node.keywords:
                if kw.arg == "metaclass" and self.resolve(kw.value) is not abc.ABCMeta:
                    return Outside(f"{where} gives {node.name} a metaclass, code that runs whenever a class is made: "
                                   "a hand-written FSDP needs plain classes (abc.ABCMeta is allowed)")
                if kw.arg != "metaclass":  # what the class statement hands its bases' hooks (enum's _simple=True)
                    return Outside(f"{where} passes `{ast.unparse(kw)}` to the class statement of {node.name}, which "
                                   "its bases' hooks read as the class is made: write plain classes (metaclass="
                                   "abc.ABCMeta is the one keyword allowed)")
            for base in node.bases:
                if problem := self.base_problem(node, base):
                    return problem
            if node.name == "FSDPModule":  # mixed into every wrapped module's class: the grader checks it there too
                names = impl.module_names()[0] - impl.MODULE_OVERRIDES - impl.CLASS_FILLED
                for stmt in node.body:
                    defined = [stmt.name] if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        else [t.id for t in stmt.targets if isinstance(t, ast.Name)] if isinstance(stmt, ast.Assign) \
                        else [stmt.target.id] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and \
                        isinstance(stmt.target, ast.Name) else []
                    if bad := [n for n in defined if n in names]:
                        return Outside(f"{self.where(stmt)} defines `{bad[0]}` in FSDPModule, a name of nn.Module's: "
                                       "fully_shard mixes FSDPModule into each module's class, where it would stand in "
                                       "for torch's method when the grader reads the model; torch's own FSDPModule "
                                       "overrides only `_apply`: name yours otherwise")
                    if defined and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or any(
                            isinstance(self.resolve(d), type) or isinstance(d, ast.Name) and d.id in _DESCRIBING or
                            isinstance(d, ast.Attribute) and d.attr in ("setter", "getter", "deleter")
                            for d in getattr(stmt, "decorator_list", ())):
                        return Outside(f"{self.where(stmt)} defines `{defined[0]}` in FSDPModule as other than a plain "
                                       "method (a class attribute, a property, a class): fully_shard mixes FSDPModule "
                                       "into each module's class, where it could hide the module's own attributes "
                                       "from the grader; keep state on the module (self._fsdp_state) and define "
                                       "plain methods")
            return None
        if isinstance(node, ast.MatchClass):  # `case C(attr=x)` reads x = subject.attr
            if node.patterns and not (isinstance(node.cls, ast.Name) and node.cls.id in SELF_MATCHING
                                      and node.cls.id not in self.bound and len(node.patterns) == 1):
                return Outside(f"{where} matches `{ast.unparse(node.cls)}(...)` by position, which reads the attributes "
                               "the class's __match_args__ name (whatever a class made at run time says): match by "
                               "keyword, case C(attr=x)")
            return next(filter(None, (self.attribute_problem(a, node) for a in node.kwd_attrs)), None)
        if isinstance(node, ast.Call):
            return self.call_problem(node)
        return None

    def enum_problem(self, node: ast.ClassDef) -> str | None:
        """An enum of the file is its members, each `NAME = value` (a constant, a tuple of them, or auto()), and methods:
        read so, its members are the ones enum makes (a descriptor, a private name, `_ignore_` or a function is none),
        and it has at least one, so its functional API (`E("X", names)`, which sets attributes of any name on the class
        it makes) refuses to extend it."""
        flag = any(isinstance(b, type) and issubclass(b, enum.Flag) for b in map(self.resolve, node.bases))
        for base in node.bases:  # a mixin's attributes (a `_value_` property) change which members enum makes
            value = self.resolve(base)
            if not (isinstance(value, type) and issubclass(value, enum.Enum) or isinstance(base, ast.Name) and (
                    base.id in self.own_enums or base.id in ENUM_MIXINS)):
                return Outside(f"{self.where(node)} derives the enum {node.name} from `{ast.unparse(base)}`: an enum of "
                               "the file derives from enum's classes only (a mixin's attributes change which members "
                               "enum makes)")
        members, names = 0, set()
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name.startswith("_") and \
                    statement.name.endswith("_") and not _dunder(statement.name):
                return Outside(f"{self.where(statement)} defines `{statement.name}` in the enum {node.name}: enum calls "
                               "it as it makes members (`_generate_next_value_` says what auto() is, and so which "
                               "members there are): write the members' values out, and plain methods")
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Pass)) or \
                    isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) or \
                    isinstance(statement, ast.AnnAssign) and statement.value is None:  # an annotation: no member
                continue
            targets = statement.targets if isinstance(statement, ast.Assign) else \
                [statement.target] if isinstance(statement, ast.AnnAssign) else None
            if targets and all(isinstance(t, ast.Name) and not t.id.startswith("_") for t in targets) \
                    and self.member_value(statement.value, names):
                # a Flag's members are its single bits (0 and several bits are no member of it)
                bits = _int_value(statement.value)
                members += not flag or isinstance(statement.value, ast.Call) or \
                    bits is not None and bits > 0 and bits & (bits - 1) == 0
                names.update(t.id for t in targets)
                continue
            return Outside(f"{self.where(statement)} writes `{ast.unparse(statement)[:80]}` in the enum {node.name}: an "
                           "enum's body is its members, each NAME = value (a constant, a tuple of constants, or "
                           "auto()) on a line of its own, and its methods")
        if not members:
            return Outside(f"{self.where(node)} makes {node.name}, an enum with no members, which its functional API "
                           f"extends with members of any name (`{node.name}(\"X\", names)`): write its members out (a "
                           "base enum of methods only: put the methods on the enum that has the members; a Flag's "
                           "members are single bits, 1, 2, 4, or auto())")
        return None

    def member_value(self, value: ast.expr, members: set[str]) -> bool:
        """A value enum makes a member of: a constant, a negated one, one made of two (1 << 2, or a Flag's composite of
        earlier members, A | B), a tuple of them, or auto()."""
        if isinstance(value, ast.Tuple):
            return all(self.member_value(v, members) for v in value.elts)
        if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub):
            value = value.operand
        if isinstance(value, ast.BinOp):
            return all(isinstance(v, ast.Name) and v.id in members or self.member_value(v, members)
                       for v in (value.left, value.right))
        return isinstance(value, ast.Constant) or isinstance(value, ast.Call) and self.resolve(value.func) is enum.auto \
            and not value.args and not value.keywords

    def type_in_place(self, node: ast.Name, parent: ast.AST | None) -> bool:
        """`type` where it stands: called, subscripted (type[X]), an annotation, or a class isinstance or issubclass is
        given (alone or in a tuple)."""
        if isinstance(parent, ast.Call) and parent.func is node or isinstance(parent, ast.Subscript) and \
                parent.value is node:
            return True
        child, above = node, parent
        while above is not None and not isinstance(child, ast.stmt):  # anywhere in an annotation (dict[str, type])
            if isinstance(above, (ast.arg, ast.AnnAssign)) and above.annotation is child or \
                    isinstance(above, (ast.FunctionDef, ast.AsyncFunctionDef)) and above.returns is child:
                return True
            child, above = above, self.parents.get(id(above))
        holder = self.parents.get(id(parent)) if isinstance(parent, ast.Tuple) else parent
        return isinstance(holder, ast.Call) and isinstance(holder.func, ast.Name) and \
            holder.func.id in ("isinstance", "issubclass") and holder.func is not node

    def name_problem(self, node: ast.Name) -> str | None:
        where = self.where(node)
        if node.id in REFUSED_BUILTINS or node.id in _FSDP2_NAMES:
            return _refuse(f"{where} uses `{node.id}`", node.id)
        if _dunder(node.id) and node.id not in ALLOWED_DUNDERS:
            if node.id in PICKLING_HOOKS:
                return Outside(f"{where} defines `{node.id}`: {_PICKLE_ADVICE}")
            return Outside(f"{where} uses `{node.id}`: it reaches modules, globals or code objects, which a "
                           "hand-written FSDP does not need; " + _ARGS)
        parent = self.parents.get(id(node))
        if node.id == "type" and isinstance(node.ctx, ast.Load) and not self.type_in_place(node, parent):
            return Outside(f"{where}: type passed around (the loader's own, under another name where the check cannot "
                           "see what it makes): call it as type(x), or write type[X] in an annotation")
        if node.id in ("getattr", "hasattr", "setattr", "delattr") and not (
                isinstance(parent, ast.Call) and parent.func is node):
            return Outside(f"{where}: {node.id} passed around (not called with a written-out name): call it "
                           f"as {node.id}(obj, \"name\"), or write obj.name")
        if node.id in self.module_aliases and isinstance(node.ctx, ast.Load) and not (
                isinstance(parent, ast.Attribute) and parent.value is node):
            return Outside(f"{where} passes the module `{node.id}` around: use its members by name "
                           f"({node.id}.something), so the check can read what is used")
        return None

    def call_problem(self, node: ast.Call) -> str | None:
        where = self.where(node)
        func = node.func.id if isinstance(node.func, ast.Name) else None
        # Differentiating runs autograd's own backward nodes, which the overlap check counts as the model's
        # compute (harness/tools/traces/schedule.py): the training loop's loss.backward() is the only backward.
        import torch

        resolved = self.resolve(node.func)
        # any weak reference's class (weakref.ref, WeakMethod, KeyedRef: a callback with a key), a proxy, a finalizer
        weak = isinstance(resolved, type) and issubclass(resolved, weakref.ref) or resolved is weakref.proxy
        if (weak or resolved is weakref.finalize) and (
                len(node.args) + len(node.keywords) > 1 or resolved is weakref.finalize):
            return Outside(f"{where} gives `{ast.unparse(node.func)}` a callback, which Python runs where an object goes, "
                           "inside whatever torch call freed it, past what watches torch's calls: keep plain weak "
                           "references (weakref.ref(x)) and do the work where you drop them")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "backward" \
                or resolved is torch.autograd.grad or resolved is torch.autograd.backward:
            return Outside(f"{where} runs a backward of its own (`{ast.unparse(node.func)}`): an FSDP never "
                           "differentiates; the training loop's loss.backward() runs its hooks")
        if problem := self.container_problem(node):
            return problem
        if isinstance(resolved, type) and issubclass(resolved, (torch.distributed.ProcessGroup, torch.distributed.Backend)):
            return Outside(f"{where} makes a process group of its own (`{ast.unparse(node.func)}`), whose collectives "
                           "the grader does not see: use the mesh fully_shard is given")
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("__enter__", "__exit__"):
            return Outside(f"{where} calls `{ast.unparse(node.func)}` itself: enter a context with a `with` "
                           "statement, which also leaves it (a context entered and never left stays on for the "
                           "whole process)")
        if func in ATTRIBUTE_BUILTINS and (len(node.args) < 2 or node.keywords
                                           or any(isinstance(a, ast.Starred) for a in node.args)):
            return Outside(f"{where} calls {func} with its arguments unpacked or by keyword "
                           f"(`{ast.unparse(node)}`): write them out, {func}(obj, \"name\"{', value' if func == 'setattr' else ''})")
        if func in ATTRIBUTE_BUILTINS:
            key = node.args[1]
            if func in ("setattr", "delattr") and (problem := self.write_problem(node.args[0], f"calls {func} on")):
                return problem
            if func in ("setattr", "delattr") and isinstance(key, ast.Constant) and isinstance(key.value, str) \
                    and (problem := self.named_write_problem(node, key.value, node.args[0])):
                return problem
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if key.value in self.own_methods and self.a_class(node.args[0]):
                    return Outside(f"{where} takes the method `{key.value}` from the class `{ast.unparse(node.args[0])}`, where "
                                   "its first argument is whatever the call passes: call methods on your instances")
                return self.attribute_problem(key.value, node)
            if func in ("getattr", "hasattr"):
                given = self.given_lookup(node)
                if given is not None and self.lookup_problems[id(given)] is None:
                    return None
                return Outside(f"{where}: {func} with a computed attribute name: write the name out, e.g. "
                               f"{func}(obj, \"name\") or obj.name" + (
                                   "" if given is None else f" (register_fsdp_forward_method may make this one "
                                   f"lookup only as given in the skeleton: {self.lookup_problems[id(given)]})"))
            # setattr/delattr with a computed name on the file's own objects is how a module's
            # parameter is swapped under its name; the object is checked above, the name cannot be.
            return None
        if isinstance(resolved, type) and issubclass(resolved, type) and resolved is not type:
            return Outside(f"{where} calls the metaclass `{ast.unparse(node.func)}`, which makes a class from a namespace "
                           "at run time: write the class out (class Name(Base): ...)")
        if isinstance(node.func, ast.Attribute) and isinstance(resolved, types.FunctionType) and \
                isinstance(self.resolve(node.func.value), type) and not (
                    node.args and not isinstance(node.args[0], ast.Starred) and self.on_own_instance(node, node.args[0])):
            return Outside(f"{where} calls `{ast.unparse(node.func)}` through its class: a method written in Python acts "
                           "on whatever it is given as self (a class, a module), so call it on your instances "
                           f"(obj.{node.func.attr}(...)), or with self in your own method (Base.{node.func.attr}(self, ...))")
        if problem := self.type_argument_problem(node):
            return problem
        if func == "type" and len(node.args) == 1 and self.class_of_something(node.args[0]):
            return Outside(f"{where} takes `{ast.unparse(node)}`, the class of a class (a metaclass, which makes classes "
                           "from any namespace): write classes out")
        if (func == "type" or isinstance(node.func, ast.Name) and node.func.id in self.own_enums) and _unpacks(node):
            return Outside(f"{where} calls `{ast.unparse(node.func)}` with its arguments unpacked (`*` or `**`): write them "
                           "out, so the check can read which class it makes or which member it looks up")
        if func == "type" and len(node.args) == 3:
            namespace = node.args[2]
            if not (isinstance(namespace, ast.Dict) and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) for k in namespace.keys)):
                return Outside(f"{where} makes a class with type() from a namespace it does not show: write the "
                               "class out (class Name(Base): ...), or pass a dict literal with written-out names")
            for key, value in zip(namespace.keys, namespace.values):
                if key.value == "__slots__" and (problem := self.slots_problem(value)):
                    return problem
                if key.value == "__module__":
                    return Outside(f"{where} makes a class with `__module__`: a class of the file belongs to the file "
                                   "(one that names torch's module passes for torch's); leave it out")
                if key.value in PICKLING_HOOKS:
                    return Outside(f"{where} makes a class with `{key.value}`: {_PICKLE_ADVICE}")
                if _dunder(key.value) and key.value not in ALLOWED_METHODS:
                    return Outside(f"{where} makes a class with `{key.value}`, a hook Python calls on its own, "
                                   "which a hand-written FSDP does not need: write a plain method and call it")
            return None
        # torch's or Python's classes handed to the file's own functions, where a computed-name setattr (the way a
        # module's parameter is swapped) could then write over their methods.
        if func in self.own_functions:
            for arg in _given(node):
                if isinstance(self.resolve(arg), type) or isinstance(arg, ast.Name) and arg.id in (
                        self.foreign | self.class_vars) or isinstance(arg, ast.Call) and self.foreign_value(arg) \
                        or self.class_of_something(arg):
                    return Outside(f"{where} passes `{ast.unparse(arg)}`, torch's or Python's, to its own function "
                                   f"{func}, which could change it: pass your own objects, and use torch's classes "
                                   "in place (isinstance(x, torch.Tensor))")
        value = resolved
        own_enum = isinstance(node.func, ast.Name) and node.func.id in self.own_enums
        if (isinstance(value, type) and issubclass(value, enum.Enum) or own_enum) and (
                len(node.args) >= 2 or any(kw.arg in _ENUM_API_KEYWORDS for kw in node.keywords) or _unpacks(node)):
            return Outside(f"{where} makes an enum from strings, whose functional API sets any attribute on the "
                           "class it makes: write the enum out as a class")
        return None


# [Note: the one lookup by a run-time name]
# FSDP2's register_fsdp_forward_method patches the method its caller names, so it must look the
# method up by a name given at run time, which the check refuses anywhere else. A file may hold it
# exactly as the reference gives it (given code in the skeleton, fsdp.py; a test keeps the
# two equal), compared as syntax, docstring aside. Equal text is not enough: every name the function
# calls must mean what it means in the reference, or the guard bends into a general getattr (an
# isinstance that says yes to `os`, a functools.wraps that hands the looked-up object out). So:
# - the builtins it calls (GIVEN_LOOKUP_BUILTINS) are bound nowhere in the file;
# - functools is bound only by `import functools`, nn only by `from torch import nn`, both at the top;
# - FSDPModule is bound only by one top-level `class FSDPModule:` with no base, keyword or decorator
#   (no metaclass or ABC `register` can make isinstance say yes to what is not one);
# - the function itself sits at the top level.
# What remains is getattr on an instance of both nn.Module and the file's FSDPModule: the file's own
# objects and torch's module methods, all of which the file could reach by name anyway.
GIVEN_LOOKUP_NAME = "register_fsdp_forward_method"
GIVEN_LOOKUP = """
def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    if not (isinstance(module, nn.Module) and isinstance(module, FSDPModule)):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def forward_method(*args: Any, **kwargs: Any) -> Any:
        state = module._fsdp_state
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, forward_method)
"""
GIVEN_LOOKUP_BUILTINS = ("isinstance", "hasattr", "getattr", "setattr", "type", "ValueError")


def _shape(func: ast.FunctionDef) -> str:
    """A function's syntax without its docstring or positions."""
    body = func.body[1:] if func.body and isinstance(func.body[0], ast.Expr) and isinstance(
        func.body[0].value, ast.Constant) and isinstance(func.body[0].value.value, str) else func.body
    return func.name + ast.dump(func.args) + ast.dump(ast.Module(body=body, type_ignores=[])) + \
        "".join(map(ast.dump, func.decorator_list)) + (ast.dump(func.returns) if func.returns else "")


def _bindings(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Every node that binds a name, by the name (assignments, deletions, arguments, definitions,
    imports, except/match/with targets, global and nonlocal declarations)."""
    found: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        for name in _bound(node):
            found.setdefault(name, []).append(node)
    return found


def _unpacks(call: ast.Call) -> bool:
    """A call with an argument unpacked (`f(*xs)`, `f(**kw)`): how many, and under which names, the check cannot read."""
    return any(isinstance(a, ast.Starred) for a in call.args) or any(kw.arg is None for kw in call.keywords)


def _given(call: ast.Call) -> list[ast.expr]:
    """A call's arguments, and the items of the literal containers among them, however deep (`f([(k, cls)])`)."""
    given = [*call.args, *(kw.value for kw in call.keywords)]
    for arg in given:  # grows as it goes: a container's items are read in their turn
        inner = arg.value if isinstance(arg, ast.Starred) else arg
        if isinstance(inner, (ast.List, ast.Tuple, ast.Set)):
            given += inner.elts
        elif isinstance(inner, ast.Dict):
            given += [v for v in inner.values if v is not None]
    return given


def _int_value(node: ast.expr) -> int | None:
    """The integer a constant expression of integers is (1, 1 << 3, 2 | 4), or None."""
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) is int else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.BitOr, ast.Add, ast.Mult)):
        left, right = _int_value(node.left), _int_value(node.right)
        if left is not None and right is not None and 0 <= right < 64:
            return {ast.LShift: operator.lshift, ast.BitOr: operator.or_, ast.Add: operator.add,
                    ast.Mult: operator.mul}[type(node.op)](left, right)
    return None


def _bound(node: ast.AST) -> list[str]:
    """The names one node binds."""
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
        return [node.id]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.split(".")[0]]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
        return [node.name]
    if isinstance(node, ast.MatchMapping) and node.rest:
        return [node.rest]
    return []


def _position(node: ast.AST) -> tuple[int, int, int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0), getattr(node, "end_lineno", 0) or 0,
            getattr(node, "end_col_offset", 0) or 0)


def _refuse(text: str, name: str) -> str:
    if name in _FSDP2_NAMES:
        return f"{text}: {ADVICE[name]}"
    advice = ADVICE.get(name, _CODE if name in REFUSED_BUILTINS else _ARGS)
    return Outside(f"{text}, which a hand-written FSDP does not need: {advice}")


def _from_fsdp2(obj) -> bool:
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is not None and code.co_filename.startswith(_FSDP_DIRS):
        return True
    module = getattr(obj, "__module__", None) or ""
    return isinstance(module, str) and module.startswith(_FSDP_MODULES)


def module_problem(module) -> str | None:
    """The loaded submission exports FSDP2's objects (a re-export, however it got them)."""
    for name in ("fully_shard", "MixedPrecisionPolicy", "FSDPModule"):
        obj = getattr(module, name, None)
        if obj is not None and (_from_fsdp2(obj) or any(_from_fsdp2(c) for c in getattr(obj, "__mro__", ()))):
            return f"its {name} is {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', name)}"
    return None


# [Note: the grader reads a model by nn.Module's own methods]
# Before each read of the wrapped model (its shards, digests, the gathered parameters its probes count, the hooks it
# registers, which leaves compute), the grader walks it by its modules' own tables, never a method of theirs, and
# checks each module: its tables are nn.Module's dicts of modules and tensors, no attribute of its own hides one of
# nn.Module's names or a table's, and its class passes impl.mixin_problem ([Note: a class the file mixes into a
# module], harness/impl.py). The loader refuses the same where the file sets them; this stands behind it, uncached
# (what a class of the file's holds is read each time), with no collection between the check and the read.


_DESCRIBING = frozenset({"property", "staticmethod", "classmethod"})
"""builtins whose decoration makes a method a descriptor, not a plain function"""


def module_tree(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of `model` and every module under it, as named_modules() gives them, read from each module's own
    tables (which must be nn.Module's dicts of modules and tensors): no method of the modules runs."""
    found, seen, todo = [], set(), [("", model)]
    while todo:
        name, m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append((name, m))
        own = vars(m)
        for table, kind in (("_modules", torch.nn.Module), ("_parameters", torch.Tensor), ("_buffers", torch.Tensor)):
            held = own.get(table)
            if type(held) is not dict:
                raise AssertionError(f"{name or 'the root'}'s table {table} is a {type(held).__qualname__}, not "
                                     "nn.Module's dict: register parameters, buffers and submodules with nn.Module's "
                                     "API (register_parameter, setattr, del)")
            if bad := next((k for k, v in dict.items(held) if v is not None and not isinstance(v, kind)), None):
                raise AssertionError(f"{name or 'the root'}'s {table} holds a {type(held[bad]).__qualname__} as "
                                     f"`{bad}`: a module's tables hold modules and tensors")
        children = own["_modules"]
        todo.extend(reversed([(f"{name}.{k}" if name else k, c) for k, c in dict.items(children) if c is not None]))
    return found


def override_problem(model: torch.nn.Module) -> str | None:
    """A module of `model` whose class or own attributes stand in for torch's where the grader reads it ([Note: the
    grader reads a model by nn.Module's own methods]); None when there is none."""
    if impl.files_refused():  # a rank that trains FSDP2 only: nothing of a file's is there to stand in for torch's
        return None
    names, instance = impl.module_names()
    try:
        tree = module_tree(model)
    except AssertionError as e:
        return str(e)
    for name, m in tree:
        where = name or "the root"
        if why := impl.mixin_problem(type(m), m):
            return f"{where} is a {type(m).__qualname__}: {why}"
        own = vars(m)
        held = {k for table in impl.MODULE_TABLES for k in dict.keys(own[table])}
        # (not what torch sets on a module in place of nn.Module's data: Module.compile's _compiled_call_impl)
        if shadowed := sorted(k for k in own if k in names and k not in instance and callable(
                inspect.getattr_static(torch.nn.Module, k, None)) or k in held):
            return (f"{where} has an attribute of its own named `{shadowed[0]}`, a name of nn.Module's or of one of "
                    "its submodules, parameters or buffers, in place of torch's: set attributes on modules under names "
                    "of your own")
    return None


def model_problem(model: torch.nn.Module) -> str | None:
    """The wrapped model carries FSDP2's classes, state or hooks."""
    from torch.distributed import _composable_state

    for name, m in module_tree(model):
        where = name or "the root"
        if bad := [c for c in type(m).__mro__ if _from_fsdp2(c)]:
            return f"{where} is a {bad[0].__module__}.{bad[0].__qualname__} after wrapping"
        state = _composable_state._module_state_mapping.get(m)
        if state is not None and _from_fsdp2(type(state)):
            return f"{where} carries FSDP2's state {type(state).__qualname__}"
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            for hook in getattr(m, attr, {}).values():
                fn = getattr(hook, "func", hook)  # functools.partial
                if _from_fsdp2(fn):
                    return f"{where} has FSDP2's hook {getattr(fn, '__qualname__', fn)}"
    return None


def stack_problem() -> str | None:
    """FSDP2's source is on the current Python stack (called at every collective)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_FSDP_DIRS):
            return f"a collective was issued from FSDP2's {frame.f_code.co_name} ({Path(frame.f_code.co_filename).name})"
        frame = frame.f_back
    return None
