"""The file effdl (the FSDP under test) imports: `student` (fsdp.py) or the path of any file that defines
`fully_shard` and `MixedPrecisionPolicy` (a submission, a reference, a variant)."""

from __future__ import annotations

import __future__
import ast
import builtins
import collections
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import operator
import re
import sys
import types
import weakref
from pathlib import Path
from types import ModuleType

from harness.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STUDENT = ROOT / "fsdp.py"


def impl_path(impl: str) -> Path:
    """The file --impl names."""
    if impl == "student":
        path = STUDENT
    else:
        path = Path(impl)
        if path.suffix != ".py":
            raise ConfigError(f"--impl must be student or the path of a .py file, got {impl!r}")
        if not path.is_absolute() and not path.exists():
            path = ROOT / path  # relative to the repository, wherever the command runs
    if not path.exists():
        fix = "restore it with `git checkout fsdp.py`" if impl == "student" else "check the path"
        raise ConfigError(f"--impl {impl}: effdl's file is not there ({path} is missing); {fix}")
    return path.resolve()


def run_name(fsdp: str, impl: str) -> str:
    """Folder name for one implementation's traces and snapshots: fsdp2, none, effdl (fsdp.py),
    effdl-<path> for another file, so runs of different files never overwrite each other."""
    if fsdp != "effdl":
        return fsdp
    path = impl_path(impl)
    if path == STUDENT.resolve():
        return "effdl"
    if path.is_relative_to(ROOT):
        return "effdl-" + "-".join(path.relative_to(ROOT).with_suffix("").parts)
    return f"effdl-{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


FILE_MODULES = "effdl_fsdp_"
"""how the module of every file under test is named: this, then a hash of its path"""


_REFUSED: str | None = None


def refuse_files(reason: str) -> None:
    """From now on this process imports no file under test (`load` raises, saying `reason`): a rank
    whose results the grader trusts (harness/tools/grading/ranks.py) runs FSDP2 only."""
    global _REFUSED
    _REFUSED = reason


def files_refused() -> bool:
    """Whether this process imports no file under test (refuse_files): a rank that trains FSDP2 only."""
    return _REFUSED is not None


def load(impl: str) -> ModuleType:
    """Import effdl (once per file) and check it has what train.py calls."""
    if _REFUSED:
        raise RuntimeError(f"--impl {impl}: {_REFUSED}")
    path = impl_path(impl)
    name = f"{FILE_MODULES}{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        store, delete = _guarded(setattr, name), _guarded(delattr, name)
        guarded_type = _guarded_type(name)
        guards = {"setattr": store, "delattr": delete, "type": guarded_type, "__import__": _guarded_import(),
                  "__build_class__": _guarded_build_class}
        # the guards in the file's own builtins too: a name the file's code deleted from its globals (what an
        # `except ... as setattr` does when its block ends) falls back to them, not to Python's
        module.__dict__.update(guards, __builtins__={**vars(builtins), **guards},
                               **{_STORE: store, _DELETE: delete, _CLASS: _class_of(guarded_type),
                                  "__effdl_operator__": operator, _HERE: _here, _BACK: _back})
        sys.modules[name] = module
        _FILES_GLOBALS.append(module.__dict__)
        guard_enum_api()
        try:
            exec(_guarded_code(path), module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
    module = sys.modules[name]
    missing = [n for n in ("fully_shard", "MixedPrecisionPolicy") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"--impl {impl}: {path} defines no {' or '.join(missing)}")
    return module


# [Note: a class the file mixes into a module]
# fully_shard gives each module it wraps a class of the file's (FSDPModule first among its bases, as FSDP2 does), and
# the grader reads the wrapped model as torch's: its parameters and submodules (named_parameters, parameters,
# modules), the hooks it registers on its blocks, `model.layers`. A class of the file's in a module's class stands in
# for torch's wherever it defines what those reads look up: one of nn.Module's names, or a submodule's, parameter's or
# buffer's name (a property `layers` showed the grader's probes decoy blocks), a method the module's own class defines
# (a `values` of the blocks' ModuleDict ran each block's forward past its hooks, with full parameters kept aside), or
# anything but a plain method (a descriptor runs the file's code on a mere lookup). FSDP2's FSDPModule defines plain
# methods, and overrides `_apply` alone of nn.Module's; so may the file's (a module class wholly the file's own, which
# stands in for no class of the model's, also defines `__init__`, `forward` and `extra_repr`, as any module does). So
# a module's class is checked where the file sets it (`__class__`, through the loader's setattr), and again before
# every read of the grader's (handwritten.override_problem); a class of the file's, once in a module's class, changes
# no more; and the file sets none of nn.Module's names on a module, nor its tables to anything but dicts. Which
# classes are the file's is what it made (`_MADE`), not what their `__module__` says (a `__name__` rebound around a
# class statement gave one torch's).
MODULE_OVERRIDES = frozenset({"_apply"})
"""nn.Module's names a class of the file's may define: what FSDP2's FSDPModule overrides"""
CLASS_FILLED = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
                          "__firstlineno__", "__static_attributes__", "__abstractmethods__", "_abc_impl",
                          "__parameters__", "__orig_bases__"})
"""what a class statement, or its bases' metaclass, fills in itself (abc's for a class mixed into torch's
CheckpointWrapper, an ABC; typing's for a generic)"""
MODULE_TABLES = ("_modules", "_parameters", "_buffers")
_MIXED: weakref.WeakSet = weakref.WeakSet()  # the file's classes found in a module's class (setattr's, delattr's)


@functools.cache
def module_names() -> tuple[frozenset[str], frozenset[str]]:
    """(every name nn.Module's class has, what nn.Module.__init__ sets on each instance)."""
    import torch

    return frozenset(dir(torch.nn.Module)), frozenset(vars(torch.nn.Module()))


def files_class(cls) -> bool:
    """`cls` is a class a file under test made (a class statement, its guarded type: whatever `__module__` it was
    given), or one its module's name says is the file's (what enum's functional API makes for it)."""
    module = vars(cls).get("__module__")
    return cls in _MADE or type(module) is str and module.startswith(FILE_MODULES)


OWN_MODULE = frozenset({"__init__", "forward", "extra_repr"})
"""what a module class of the file's own (no class but the file's, nn.Module and object in its MRO) defines as any
module does: it stands in for no class of torch's or the model's"""


def mixin_problem(cls: type, module) -> str | None:
    """Why `cls` may not be `module`'s class ([Note: a class the file mixes into a module]), or None."""
    import torch

    files = [c for c in cls.__mro__ if files_class(c)]
    if not files:  # (torch's and the model's classes only: the file changes none of them)
        return None
    names = module_names()[0]
    held = set()
    for table in MODULE_TABLES:
        if type(found := vars(module).get(table)) is dict:
            held.update(dict.keys(found))
    own = all(c in files or c is torch.nn.Module or c is object for c in cls.__mro__)
    theirs = {}  # every name the classes not the file's define (the model's, torch's): the first that does
    for c in reversed(cls.__mro__):
        if c not in files:
            theirs.update(dict.fromkeys(vars(c), c))
    for c in files:
        for name, value in vars(c).items():
            if name in CLASS_FILLED or own and name in OWN_MODULE and type(value) is types.FunctionType:
                continue
            if type(value) is not types.FunctionType:
                return (f"its class's base {c.__qualname__} (the file's) defines `{name}` as a {type(value).__name__}, "
                        "not a plain method: a class mixed into a module defines plain methods only (a descriptor "
                        "runs on a mere lookup)")
            if name in MODULE_OVERRIDES:
                continue
            if name in names:
                return (f"its class's base {c.__qualname__} (the file's) defines `{name}`, a name of nn.Module's, in "
                        "place of torch's: a class mixed into a module defines none of nn.Module's methods but `_apply` "
                        "(as FSDP2's FSDPModule); name yours otherwise")
            if name in theirs:
                return (f"its class's base {c.__qualname__} (the file's) defines `{name}`, which its class "
                        f"{theirs[name].__qualname__} defines: a class mixed into a module adds methods and overrides "
                        "none of the module's own (the model calls them: `values()` of the blocks' ModuleDict, "
                        "`init_weights`); name yours otherwise")
            if name in held:
                return (f"its class's base {c.__qualname__} (the file's) defines `{name}`, the name of one of its "
                        "submodules, parameters or buffers, which it would hide: name yours otherwise")
    return None


# [Note: setattr and delattr of a file under test]
# An FSDP sets a module's parameter under a name it computes (`setattr(module, name, param)`), and the
# source check (harness/tools/grading/handwritten.py) cannot follow a computed name to the object it
# lands on: a loop variable, a list item or a default argument may hold torch's class. So the file is
# loaded with its own setattr and delattr (the check keeps it from rebinding them or reaching the
# builtins past them), which write only onto instances (the file's own objects, modules, tensors, an
# autograd Function's ctx), never onto a class, a module or a function the file did not define, and no
# dunder that leads to code. `obj.name = value` in the file is rewritten to the same call (_GuardStores).
_WRITABLE_DUNDERS = frozenset({"__class__", "__doc__", "__name__", "__qualname__"})


def _guarded(builtin, own: str):
    import inspect
    import types

    import torch

    instances = (torch.Tensor, torch.nn.Module, torch.autograd.function.FunctionCtx)
    not_instances = (type, ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                     types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
                     types.ClassMethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
                     property, staticmethod, classmethod, types.FrameType, types.TracebackType, types.CodeType,
                     types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, types.CellType)

    # a module's own tables (its hooks: the grader's on the model's blocks among them) and its private machinery
    # (`_call_impl`, which runs them); not the tables of its parameters, buffers and submodules, which the source
    # check lets an FSDP use (handwritten.PRIVATE_ATTRS)
    module_state = frozenset(vars(torch.nn.Module())) - {"_parameters", "_buffers", "_modules"} | {
        n for n in dir(torch.nn.Module) if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}

    def refused(obj, name, why: str) -> TypeError:  # the call as the file wrote it, only when refused
        shown = obj if isinstance(obj, not_instances) else type(obj).__name__
        return TypeError(f"{builtin.__name__}({shown!r}, {name!r}, ...): {why}")

    mixed = _MIXED

    def guarded(obj, name, *value):  # every attribute write of the file: only checks here, nothing built
        if type(name) is not str:  # a str of the file's class answers the tests below its own way (its __len__)
            raise refused(obj, name, "a file under test names an attribute with a plain str")
        if len(name) > 4 and name[:2] == name[-2:] == "__" and name not in _WRITABLE_DUNDERS:
            raise refused(obj, name, f"a file under test writes no {name} (a hook or a way to code); write plain "
                          "attributes")
        if len(name) > 2 and name[0] == name[-1] == "_" and name[1] != "_" and name[-2] != "_":
            raise refused(obj, name, f"a file under test writes no {name} (enum's bookkeeping and hooks are named so: "
                          "`_member_names_`, `_missing_`); name your attribute otherwise")
        if isinstance(obj, torch.nn.Module) and name in module_state:
            raise refused(obj, name, "a file under test replaces none of a module's own tables (its hooks, its "
                          "training flag) or private methods: use nn.Module's API (register_parameter, "
                          "register_forward_pre_hook, ...) and name your own attributes otherwise")
        if isinstance(obj, torch.nn.Module) and name in module_names()[0] and name != "__class__":
            raise refused(obj, name, "a file under test sets none of nn.Module's names on a module (the grader calls "
                          "them there as torch's: [Note: a class the file mixes into a module]): name your attribute "
                          "otherwise")
        if isinstance(obj, torch.nn.Module) and name in MODULE_TABLES and (not value or type(value[0]) is not dict):
            raise refused(obj, name, "a module's tables of parameters, buffers and submodules stay nn.Module's dicts: "
                          "register them with nn.Module's API (register_parameter, setattr, del)")
        if name == "__class__" and isinstance(obj, torch.nn.Module) and value:
            if not isinstance(value[0], type):
                raise refused(obj, name, "a module's class is a class")
            if why := mixin_problem(value[0], obj):
                raise refused(obj, name, why)
            mixed.update(c for c in value[0].__mro__ if files_class(c))
        if isinstance(obj, type) and obj in mixed:
            raise refused(obj, name, "a class of the file's in a module's class changes no more (the grader reads the "
                          "module as torch's: [Note: a class the file mixes into a module]): set what changes on "
                          "instances")
        if isinstance(obj, torch.Tensor):
            defined = inspect.getattr_static(type(obj), name, None)  # what the tensor's class names so
            if name[:1] == "_" and defined is not None:
                raise refused(obj, name, "a file under test writes none of a tensor's internals (its hooks, "
                              "autograd's state, a DTensor's local tensor and spec): use the tensor's API and name "
                              "your own attributes otherwise")
            if callable(defined):
                raise refused(obj, name, "a file under test sets no attribute named as a method of the tensor's class "
                              "(the collective log and torch call it on that tensor): name your attribute otherwise")
        if name == "__class__" and not isinstance(obj, torch.nn.Module):  # FSDP swaps a module's class only
            raise refused(obj, name, "a file under test changes the class of modules only (an autograd ctx's class "
                          "names its backward node)")
        if isinstance(obj, not_instances):
            if getattr(obj, "__module__", None) != own:
                raise refused(obj, name, "a file under test changes only its own objects, never torch's or Python's "
                              "classes, modules or functions (that would change them for the whole process); set "
                              "attributes on instances: your objects, modules, tensors")
        elif not (type(obj).__module__ in (own, "builtins", "types") or isinstance(obj, instances)):
            raise refused(obj, name, "a file under test sets attributes by a computed name only on its own objects, "
                          f"modules and tensors, not on an instance of {type(obj).__module__}.{type(obj).__qualname__}")
        return builtin(obj, name, *value)

    guarded.__name__ = guarded.__qualname__ = builtin.__name__
    return guarded


# [Note: classes a file under test makes at run time]
# `type(name, bases, namespace)` makes a class whose namespace the source check may not see (computed
# keys: a `__torch_dispatch__` that hides collectives from the collective log, a `__match_args__` that
# turns `case C(x)` into a getattr), and the class of a class is a metaclass that makes such classes
# (`type(type(x))`, `x.__class__.__class__`). So the file's `type` is a guard, and its `__class__` reads
# go through one: type(x) of an instance is its class; the class of a class (whatever its metaclass) is
# the guard itself; a class made from three arguments derives from the file's own classes, object,
# nn.Module or autograd.Function only, with a namespace of plain names (and those a class statement
# fills in). What FSDP does with it, `type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})`, passes.
_CLASS_DUNDERS = frozenset({"__module__", "__qualname__", "__doc__", "__slots__"})  # what a class statement fills in


class _TypeCheck(type):
    """isinstance(x, type) and issubclass(c, type) with the file's guarded `type` mean what they always do."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, type)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, type)


class _TypeAnnotation:
    """`type[X]` as the guarded type gives it: an annotation, which no call makes into Python's own type, and which
    keeps only how it reads (X itself, held here, would leave its place under the file's name)."""

    __slots__ = ("_text",)

    def __init__(self, item):
        name = item.__qualname__ if isinstance(item, type) else repr(item)
        self._text = f"type[{name}]"

    def __repr__(self) -> str:
        return self._text


def _guarded_type(own: str):
    import torch

    def refused(why: str) -> TypeError:
        return TypeError(f"type(...): {why}")

    class type_(type, metaclass=_TypeCheck):
        def __class_getitem__(cls, item):  # type[X] in an annotation: nothing to call (Python's type[X] calls type)
            return _TypeAnnotation(item)

        def __new__(mcs, *args):
            if len(args) == 1:
                return class_of(args[0])
            if len(args) != 3:
                raise refused("takes 1 or 3 arguments")
            name, bases, namespace = args
            namespace = dict(namespace)  # one copy, checked and made from (a mapping may say other keys each time)
            for base in bases:
                if not (base is object or isinstance(base, type) and (
                        base.__module__ == own or base in _MADE
                        or issubclass(base, (torch.nn.Module, torch.autograd.Function)))):
                    raise refused(f"a class made by a file under test derives from its own classes, object, nn.Module "
                                  f"or autograd.Function, not {base!r}")
            for key in namespace:
                if type(key) is not str or key.startswith("__") and key.endswith("__") and key not in _CLASS_DUNDERS:
                    raise refused(f"a class made by a file under test has plain names, not {key!r} (a hook Python "
                                  "calls on its own): write the class out")
            if "__module__" in namespace and (type(namespace["__module__"]) is not str or namespace["__module__"] != own):
                raise refused("a class made by a file under test belongs to the file: leave `__module__` out of its "
                              "namespace (a class that names torch's module passes for torch's)")
            made = type(name, bases, {**namespace, "__module__": own})  # the file's, as its own type() would say
            _check_made(made, name)
            return made

    type_.__name__ = type_.__qualname__ = "type"
    class_of = _class_of(type_)
    return type_


def _class_of(guarded_type):
    """`obj.__class__` (and `type(obj)`) in a file under test: see [Note: classes a file under test makes at run time]."""

    def class_of(obj):
        found = obj.__class__
        if isinstance(found, type) and issubclass(found, type):  # obj is a class: its class is a metaclass
            return guarded_type
        return found

    return class_of


# [Note: the dataclass of a file under test]
# dataclass compiles the names of a class's fields into the code of the methods it writes (__init__, __repr__,
# __eq__), executed with the file's globals, and takes its fields from whatever passes for a dataclasses.Field
# (isinstance, which believes an object's `__class__`), its bases' fields as it finds them. The source check keeps
# the file from defining `__class__` or renaming a Field; behind it, the file's `dataclasses` (imported through the
# guarded __import__) is Python's but for `dataclass`, which makes a class only from fields that are
# dataclasses.Field itself, each under its own plain name (an identifier), its bases' too; and no class statement of the
# file makes a class that passes for a Field (_guarded_build_class).
def _checked_dataclass(real):
    import dataclasses
    import inspect
    import keyword
    import types

    def plain(name) -> bool:
        return type(name) is str and name.isidentifier() and not keyword.iskeyword(name)

    def answers(held) -> bool:
        """An object whose lookups run code of a file under test: a class the file made (_MADE) defines a lookup hook
        of any kind (a __get__ that toggles what the check and dataclass read, a functools.partial as one); the
        lookups of Python's and torch's objects, and of the file's plain objects (an enum member), run none."""
        return any(kind in _MADE and any(hook in vars(kind) for hook in _LOOKUP_HOOKS) for kind in type(held).__mro__)

    def checked(cls):
        def refuse(held, key):
            raise TypeError(f"dataclass({cls.__qualname__}): a field of a file under test is a dataclasses.Field under "
                            f"its own plain name (an identifier), not {type(held).__qualname__} {key!r}: write fields "
                            "as `name: type = default` or dataclasses.field(...)")

        for base in cls.__mro__:
            namespace = dict(vars(base))
            fields = namespace.get("__dataclass_fields__") if base is not cls else {
                k: v for k, v in namespace.items() if isinstance(v, dataclasses.Field)}
            for key, field in dict(fields or {}).items():
                if type(field) is not dataclasses.Field or not plain(key) or base is not cls and field.name != key:
                    refuse(field, key)
            for key, held in namespace.items():  # what dataclass may take as a default by getattr, read in place
                if isinstance(held, dataclasses.Field) and type(held) is not dataclasses.Field:
                    refuse(held, key)
                if answers(held):
                    raise TypeError(f"dataclass({cls.__qualname__}): a default of a file under test is read as it is, "
                                    f"but {key!r} holds a {type(held).__qualname__}, whose lookups run the file's code: "
                                    "give plain values as defaults")
        for name in cls.__dict__.get("__annotations__", {}):  # as dataclass reads it: once, here, and pinned
            held = inspect.getattr_static(cls, name, dataclasses.MISSING)  # (its metaclass's too; no code runs)
            if held is dataclasses.MISSING:
                continue
            if isinstance(held, dataclasses.Field) and type(held) is not dataclasses.Field:
                refuse(held, name)
            if hasattr(type(held), "__get__") and not isinstance(held, (types.FunctionType, types.BuiltinFunctionType)):
                raise TypeError(f"dataclass({cls.__qualname__}): a default of a file under test is read as it is, but "
                                f"{name!r} holds a {type(held).__qualname__}, which runs code when it is read: give "
                                "plain values as defaults")
            if vars(cls).get(name, dataclasses.MISSING) is not held:  # what dataclass reads is what was checked
                type.__setattr__(cls, name, held)
        for name in cls.__dict__.get("__annotations__", {}):
            if not plain(name):
                raise TypeError(f"dataclass({cls.__qualname__}): a field's name is an identifier, not {name!r}")
        return cls

    def dataclass(cls=None, /, **kwargs):
        if cls is None:
            return lambda c: dataclass(c, **kwargs)
        made = real(checked(cls), **kwargs)
        if made is not cls:  # slots=True: a class dataclass made anew, past the guard of class statements
            _check_made(made, made.__qualname__)
        return made

    dataclass.__name__ = dataclass.__qualname__ = "dataclass"
    dataclass.__doc__ = real.__doc__
    return dataclass


def _guarded_build_class(func, name, *bases, **kwargs):
    """The file's class statements: Python's, but no class of the file passes for a dataclasses.Field (a subclass of
    it, or one whose `__class__` says so), which dataclass would take as a field whatever its name, and no enum of the
    file is without members (however enum read its body: its functional API, which makes classes past this guard,
    extends only such an enum)."""
    made = builtins.__build_class__(func, name, *bases, **kwargs)
    _check_made(made, name)
    return made


_MADE: weakref.WeakSet = weakref.WeakSet()
"""every class a file under test made with a class statement or type()"""
_LOOKUP_HOOKS = ("__get__", "__set__", "__delete__", "__getattr__", "__getattribute__")
READ_AS_DATA = ("__iter__", "__next__", "__getitem__", "__len__", "__contains__", "__index__", "__int__", "__float__",
                "__complex__", "__bool__")
"""the methods by which torch reads an object handed to it as numbers or a sequence"""
_READ_AS_DATA: weakref.WeakSet = weakref.WeakSet()
"""the classes a file under test made that define one of READ_AS_DATA (or inherit it from another such)"""


_FILES_GLOBALS: list[dict] = []
"""the globals of every file under test this process loaded: a function whose globals they are is the file's"""


def runs_files_code(obj, depth: int = 0) -> bool:
    """Whether torch, handed `obj`, might call code of a file under test: a class of the file or its object (any of
    its methods: `__eq__`, `__hash__`, `__call__`...), a function or generator of the file, or a method, a partial or
    a builtin's method that holds one, an iterator torch would draw from (map, filter, itertools', a weak proxy),
    a container of Python's holding one. Read by attributes and iteration Python keeps (no code of the file runs).
    Asked for every argument of every call of torch's where a file is loaded: its imports are the module's."""
    if depth > 8:  # a wrapper of a wrapper of ...: taken for what it may hold
        return True
    kind = type(obj)  # (by its type, never `isinstance(obj, ...)`: a weak proxy or a lookup hook answers that)
    if _INERT.get(id(kind)) is kind:  # a tensor, a number, a dtype...: known by its type alone (no hash of it run)
        return False
    if kind in _LAZY or kind.__module__ == "itertools":
        return True
    if issubclass(kind, type) and obj in _MADE:  # called, it runs the file's __init__
        return True
    if kind in _MADE and _holds_files_code(kind):  # a plain NamedTuple, record or enum member of the file's runs none
        return True
    if issubclass(kind, (list, tuple, dict, set, frozenset, collections.deque)) or kind in _VIEWS:
        items = _held_by(obj) if issubclass(kind, (list, tuple, dict, set, frozenset)) else list(obj)  # C iteration
        factory = collections.defaultdict.default_factory.__get__(obj) if issubclass(kind, collections.defaultdict) \
            else None  # called for a missing key
        return runs_files_code(factory, depth + 1) or any(runs_files_code(v, depth + 1) for v in items)
    if issubclass(kind, (collections.UserList, collections.UserDict)):
        return runs_files_code(vars(obj).get("data"), depth + 1)
    if issubclass(kind, collections.ChainMap):
        return runs_files_code(vars(obj).get("maps"), depth + 1)
    if kind is types.FunctionType:
        return any(obj.__globals__ is g for g in _FILES_GLOBALS)
    if kind in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
        frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        return frame is not None and any(frame.f_globals is g for g in _FILES_GLOBALS)
    if kind is types.MethodType:
        return runs_files_code(obj.__func__, depth + 1) or runs_files_code(obj.__self__, depth + 1)
    if kind in (types.BuiltinMethodType, types.MethodWrapperType):  # `mine.__eq__`, `[mine].__contains__`
        held = obj.__self__
        return not issubclass(type(held), ModuleType) and runs_files_code(held, depth + 1)
    if kind is functools.partial:
        return any(runs_files_code(v, depth + 1) for v in (obj.func, *obj.args, *obj.keywords.values()))
    if kind in (staticmethod, classmethod):  # callable since Python 3.10
        return runs_files_code(obj.__func__, depth + 1)
    if kind is slice:  # its bounds read by their __index__
        return any(runs_files_code(v, depth + 1) for v in (obj.start, obj.stop, obj.step))
    if hasattr(kind, "__next__") and kind.__module__.split(".")[0] != "torch":  # any other iterator: a list's too
        return True
    # any other callable that is neither torch's nor a builtin (functools.cmp_to_key's wrapper, say) may hold one
    if callable(obj) and not issubclass(kind, type) and not kind.__module__.split(".")[0] in ("torch", "builtins"):
        return True
    # Each test above that this object passed reads its type only: so does any other object of this type, but a class
    # (whether it is the file's is the object's own) and the file's classes (`_holds_files_code` reads them as they are).
    if not issubclass(kind, type) and kind not in _MADE:
        _INERT[id(kind)] = kind
    return False


_LAZY = (map, filter, zip, enumerate, reversed, type(iter(lambda: 0, 1)), weakref.ProxyType, weakref.CallableProxyType)
"""what torch, drawing from it or reading it, makes run code it holds"""
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CODE_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INERT: dict[int, type] = {}
"""id(type) -> type: the types whose objects runs_files_code found to hold no code (by id, the type kept alive: no
type's `__hash__` or `__eq__` runs to look one up)"""


def _holds_files_code(kind: type) -> bool:
    """Whether a class of the file's, or one of its bases of the file's, holds code of a file under test: a method, a
    property's accessor, a static or class method (what torch may call on its object: `__eq__`, `__index__`...;
    dataclass's methods too, compiled under the file's globals). Read once per class."""
    if (known := _CODE_OF.get(kind)) is not None:
        return known
    _CODE_OF[kind] = False  # while it is read: an enum's members are its own objects
    found = any(callable(part) and not isinstance(part, type) and runs_files_code(part)
                for base in kind.__mro__ if base in _MADE for held in vars(base).values()
                for part in ([held.fget, held.fset, held.fdel] if isinstance(held, property) else
                             [held.__func__] if isinstance(held, (staticmethod, classmethod)) else [held]))
    _CODE_OF[kind] = found
    return found


def _held_by(container) -> list:
    """A builtin container's items (a dict's keys and values), read by its base type's own methods (never a
    subclass's)."""
    for base in (dict, list, tuple, set, frozenset):
        if issubclass(type(container), base):
            return [*dict.keys(container), *dict.values(container)] if base is dict else list(base.__iter__(container))
    return []


def inert(values) -> bool:
    """Whether each of `values` is of a type runs_files_code found to hold no code (a tensor, a number...), or a slice of
    such, or exactly a list, tuple or torch.Size of those (a shape, an index, a list of tensors): the common case of a
    call's arguments, told with no walk through them. Read by the exact types' own iteration (no subclass's runs)."""
    for value in values:
        kind = type(value)
        if _INERT.get(id(kind)) is kind or kind is slice and _inert_slice(value):
            continue
        if kind is not tuple and kind is not list and kind is not sys.modules["torch"].Size:
            return False
        for item in value:
            held = type(item)
            if _INERT.get(id(held)) is not held and not (held is slice and _inert_slice(item)):
                return False
    return True


def _inert_slice(value: slice) -> bool:
    """Whether a slice's bounds are each of a type known to hold no code (read by its index, they run none)."""
    for bound in (value.start, value.stop, value.step):
        kind = type(bound)
        if _INERT.get(id(kind)) is not kind:
            return False
    return True


def read_as_data(obj) -> bool:
    """Whether torch, handed `obj`, would run code of a file under test to read it (its class's READ_AS_DATA)."""
    kind = type(obj)
    return _INERT.get(id(kind)) is not kind and kind in _READ_AS_DATA  # (no class in _INERT is the file's)



def _check_made(made, name: str) -> None:
    """What every class the file makes (a class statement, its type()) is not: see _guarded_build_class."""
    import dataclasses
    import enum
    import types

    if not isinstance(made, type):
        return
    _MADE.add(made)
    if any(hook in vars(kind) for kind in made.__mro__ if kind in _MADE for hook in READ_AS_DATA):
        _READ_AS_DATA.add(made)
    for key, value in vars(made).items():  # what its __slots__ made, read off the class itself
        if isinstance(value, types.MemberDescriptorType) and key[:2] == key[-2:] == "__":
            raise TypeError(f"class {name}: a class of a file under test has slots of plain names, not {key!r} (a slot "
                            "named as a dunder stands in for what Python does under that name): name your slots "
                            "otherwise")
    if issubclass(made, dataclasses.Field) or "__class__" in vars(made):
        raise TypeError(f"class {name}: a class of a file under test neither derives from dataclasses.Field nor defines "
                        "__class__ (isinstance would take its objects for another's): write plain classes")
    if isinstance(made, enum.EnumType) and not made._member_names_:
        raise TypeError(f"class {name}: an enum of a file under test has members (one without any, its functional API "
                        "extends with members of any name, dunders included): write its members out")


# [Note: enum's functional API where a file under test runs]
# `E("Name", names)` makes a class past the loader's guard of class statements, setting on it whatever the names
# say: a dunder (a pickling hook, a `__class__` that passes for a dataclasses.Field), a sunder hook of enum's, a
# descriptor (no member, so the enum stays open to more), a `module` that is another's. The source check refuses
# such a call where it can read it; behind it, in a process that loads a file under test, the functional API makes
# members only: at least one, each name an identifier that starts with no underscore, each value no descriptor
# and no enum.member or enum.nonmember wrapper, a mixin of ENUM_MIXINS only, under the caller's module (given or
# not: enum's own lookup of the caller would find this check's frame). No one else in such a process needs more:
# torch writes its enums as classes.
ENUM_MIXINS = (str, int, float)
"""Python's own types an enum of a file under test may mix in (`class Kind(str, enum.Enum)`, `type=str`): they bring no
attribute enum reads (`_value_`, `_missing_`)"""


def guard_enum_api() -> None:
    """Put the check of [Note: enum's functional API where a file under test runs] before enum's (once)."""
    import enum

    real = enum.EnumType.__dict__["_create_"]
    if getattr(real, "_checked", False):
        return

    def refuse(what: str):
        raise TypeError(f"enum's functional API makes members only (names that are identifiers starting with no "
                        f"underscore, plain values), not {what}: write the enum out as a class")

    def member(name, value=None, given=False):
        if type(name) is not str or not name.isidentifier() or name.startswith("_"):
            refuse(f"a member named {name!r}")
        if given and (any(hasattr(value, hook) for hook in ("__get__", "__set__", "__delete__"))
                      or isinstance(value, (enum.member, enum.nonmember))):
            refuse(f"{name} = {type(value).__qualname__} (a descriptor or a wrapper enum unwraps)")
        return name

    def _create_(cls, class_name, names, *, module=None, qualname=None, type=None, **kwargs):
        if getattr(enum, cls.__name__, None) is not cls:  # an enum of anyone's emptied of its members (its bookkeeping)
            refuse(f"an extension of {cls.__qualname__} (only enum's own classes make enums from names)")
        if names is None:
            refuse("no names")
        if isinstance(names, str):
            given = [member(name) for name in names.replace(",", " ").split()]
        elif isinstance(names, (tuple, list)) and names and isinstance(names[0], str):  # values by auto()
            names = list(names)
            given = [member(name) for name in names]
        else:  # as enum reads them: names that index a mapping, or (name, value) pairs
            items = []
            for item in names:
                items.append((item, names[item]) if isinstance(item, str) else tuple(item))
                if len(items[-1]) != 2:
                    refuse(f"the item {item!r}")
                member(*items[-1], given=True)
            names, given = items, [name for name, _ in items]
        if not given:
            refuse("no members at all (an enum without any is open to more)")
        if type is not None and not any(type is mixin for mixin in ENUM_MIXINS):
            refuse(f"type={type!r} (a mixin of str, int or float only)")
        if qualname is not None and builtins.type(qualname) is not str:
            refuse(f"qualname={qualname!r}")
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == "enum":
            frame = frame.f_back
        caller = frame.f_globals.get("__name__") if frame is not None else None
        if module is not None and (builtins.type(module) is not str or module != caller):
            refuse(f"module={module!r}, another's than the caller's")
        made = real(cls, class_name, names, module=caller, qualname=qualname, type=type, **kwargs)
        # what it made, read off the class: each name a member (a value enum made itself, by its
        # _generate_next_value_, may be a descriptor too), nothing but enum's own besides
        plain = real(cls, "Plain", ["member"], module=caller, type=type)
        extra = set(vars(made)) - set(vars(plain)) - set(made._member_map_)
        if list(made._member_map_) != given or extra:
            refuse(f"{class_name} with {sorted(extra) or [n for n in given if n not in made._member_map_]} besides its "
                   "members")
        return made

    _create_._checked = True
    _create_.__qualname__ = "EnumType._create_"
    enum.EnumType._create_ = _create_


def _guarded_import():
    """The file's __import__: Python's, but `dataclasses` is a copy of it whose dataclass is checked."""
    import dataclasses

    copy = ModuleType("dataclasses", dataclasses.__doc__)
    vars(copy).update({k: v for k, v in vars(dataclasses).items() if k not in ("__builtins__", "__loader__", "__spec__")})
    copy.dataclass = _checked_dataclass(dataclasses.dataclass)

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        found = builtins.__import__(name, globals, locals, fromlist, level)
        return copy if found is dataclasses else found

    return __import__


# Every attribute the file writes with `obj.name = value` (or `+=`, or `del obj.name`) goes through the
# same guard: the source check cannot tell which object an alias holds (a list item, a loop variable,
# `t.__class__`), the guard sees it. The two names are dunders, which the file may not name.
_STORE, _DELETE, _CLASS = "__effdl_store__", "__effdl_delete__", "__effdl_class__"


def stored_attribute(target: ast.expr | None) -> ast.Attribute | None:
    """The first attribute a binding target stores into (`for self.x in ...`), or None: what the rewrite below cannot
    put through the guard, refused by the source check and on load alike."""
    return None if target is None else next((t for t in ast.walk(target) if isinstance(t, ast.Attribute)), None)


class _GuardStores(ast.NodeTransformer):
    """`a.b = v` -> `__effdl_store__(a, "b", v)`; `a.b op= v` -> the same over `operator.iop(a.b, v)`
    (in place where the value is, as Python does); `del a.b` -> `__effdl_delete__(a, "b")`. Targets that
    unpack (`self.a, self.b = ...`) assign to temporaries first. Line numbers stay the file's."""

    def __init__(self):
        self.temporaries = 0

    def call(self, name: str, *args: ast.expr) -> ast.Expr:
        return ast.Expr(ast.Call(ast.Name(name, ast.Load()), list(args), []))

    def temporary(self) -> str:
        self.temporaries += 1
        return f"__effdl_t{self.temporaries}__"

    def split(self, target: ast.expr, after: list[ast.stmt]) -> ast.expr:
        """target with each attribute in it replaced by a temporary stored after the assignment."""
        if isinstance(target, ast.Attribute):
            t = self.temporary()
            after.append(self.call(_STORE, target.value, ast.Constant(target.attr), ast.Name(t, ast.Load())))
            return ast.Name(t, ast.Store())
        if isinstance(target, (ast.Tuple, ast.List)):
            target.elts = [self.split(e, after) for e in target.elts]
        elif isinstance(target, ast.Starred):
            target.value = self.split(target.value, after)
        return target

    def visit_Assign(self, node: ast.Assign):
        self.generic_visit(node)
        after: list[ast.stmt] = []
        node.targets = [self.split(t, after) for t in node.targets]
        return [node, *(ast.copy_location(a, node) for a in after)] if after else node

    def visit_AnnAssign(self, node: ast.AnnAssign):
        self.generic_visit(node)
        if not isinstance(node.target, ast.Attribute) or node.value is None:
            return node
        return ast.copy_location(self.call(_STORE, node.target.value, ast.Constant(node.target.attr), node.value), node)

    def visit_AugAssign(self, node: ast.AugAssign):
        self.generic_visit(node)
        if not isinstance(node.target, ast.Attribute):
            return node
        t = self.temporary()
        op = ast.Attribute(ast.Name("__effdl_operator__", ast.Load()), _INPLACE[type(node.op)], ast.Load())
        read = ast.Attribute(ast.Name(t, ast.Load()), node.target.attr, ast.Load())
        return [ast.copy_location(ast.Assign([ast.Name(t, ast.Store())], node.target.value), node),
                ast.copy_location(self.call(_STORE, ast.Name(t, ast.Load()), ast.Constant(node.target.attr),
                                            ast.Call(op, [read, node.value], [])), node)]

    def visit_Attribute(self, node: ast.Attribute):
        """`x.__class__` read -> `__effdl_class__(x)`."""
        self.generic_visit(node)
        if node.attr == "__class__" and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Call(ast.Name(_CLASS, ast.Load()), [node.value], []), node)
        return node

    def unguarded(self, target: ast.expr | None) -> None:
        """A loop's, a with's or a comprehension's target stores past this rewrite: no attribute there."""
        if stored := stored_attribute(target):
            raise TypeError(f"line {stored.lineno}: a file under test stores into `{ast.unparse(stored)}` as the "
                            "target of a for, a with or a comprehension: bind a plain name there and assign the "
                            "attribute in the body")

    def visit_For(self, node: ast.For | ast.AsyncFor):
        self.unguarded(node.target)
        return self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_withitem(self, node: ast.withitem):
        self.unguarded(node.optional_vars)
        return self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension):
        self.unguarded(node.target)
        return self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete):
        """`del a.b, (c.d, e)` -> one statement per target, in Python's order, each attribute's through the guard."""
        self.generic_visit(node)

        def leaves(target: ast.expr):
            if isinstance(target, (ast.Tuple, ast.List)):
                for t in target.elts:
                    yield from leaves(t)
            else:
                yield target

        done = [ast.copy_location(self.call(_DELETE, t.value, ast.Constant(t.attr)) if isinstance(t, ast.Attribute)
                                  else ast.Delete([t]), node) for target in node.targets for t in leaves(target)]
        return done or ast.copy_location(ast.Pass(), node)  # `del ()`: nothing to delete


_INPLACE = {ast.Add: "iadd", ast.Sub: "isub", ast.Mult: "imul", ast.MatMult: "imatmul", ast.Div: "itruediv",
            ast.FloorDiv: "ifloordiv", ast.Mod: "imod", ast.Pow: "ipow", ast.LShift: "ilshift", ast.RShift: "irshift",
            ast.BitAnd: "iand", ast.BitOr: "ior", ast.BitXor: "ixor"}


# [Note: where the file's code runs]
# The collective log's function mode sees the file's calls of torch's API; torch runs the mode's handler with the mode
# off, so whatever code of the file torch runs inside a call (an object's `__index__` or `__eq__` it reads, an iterator
# it draws from, a generator's `finally` when torch frees it, a hash a weak dictionary takes) runs unseen: a read of a
# pending collective's output there is no read to the log. Which objects torch may call back is a question without end
# (runs_files_code answers it for what a file is likely to hand torch); where the file's code runs is not. So every
# place the file's code starts or resumes running calls `__effdl_here__()` first: a function's body, a lambda's, an
# except or finally block (what a closed generator runs), the point after a `with` block (where it goes on when the
# context swallowed the exception a closed generator raised at its yield), a comprehension's expressions, the point
# after each yield and await. The call asks the watcher (the log's mode, while it is on: `watching`) whether it runs inside a call of
# torch's it handles, or inside an op the log's dispatch mode handles (a kernel that calls back, with every mode off),
# or on a thread of torch's own (gloo's, freeing what a collective's work held): wherever the log's function mode is not
# on the running thread's stack, it is a problem. The file cannot name the call or avoid it (dunders are refused).
_HERE, _BACK = "__effdl_here__", "__effdl_back__"
_WATCHERS: list = []


@contextlib.contextmanager
def watching(watcher):
    """While on, `watcher()` is called wherever the file's code starts or resumes running ([Note: where the file's
    code runs])."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.remove(watcher)


def _here() -> None:
    for watcher in _WATCHERS:
        watcher()


def _back(value):
    """What a yield or an await gave the file's code, resuming: after the watcher was asked."""
    _here()
    return value


class _MarkRuns(ast.NodeTransformer):
    """`__effdl_here__()` first wherever the file's code starts or resumes running ([Note: where the file's code
    runs]). Line numbers stay the file's."""

    def here(self, at: ast.AST) -> ast.Call:
        return ast.copy_location(ast.Call(ast.Name(_HERE, ast.Load()), [], []), at)

    def first(self, body: list[ast.stmt], at: ast.AST) -> list[ast.stmt]:
        call = ast.copy_location(ast.Expr(self.here(at)), at)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):  # after a docstring, which stays one
            return [body[0], call, *body[1:]]
        return [call, *body]

    def before(self, expr: ast.expr) -> ast.expr:
        """`(__effdl_here__(), expr)[1]`: the watcher asked, then expr."""
        pair = ast.copy_location(ast.Tuple([self.here(expr), expr], ast.Load()), expr)
        return ast.copy_location(ast.Subscript(pair, ast.Constant(1), ast.Load()), expr)

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.body = self.first(node.body, node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.generic_visit(node)
        node.body = self.before(node.body)
        return node

    def visit_ExceptHandler(self, node):
        self.generic_visit(node)
        node.body = self.first(node.body, node)
        return node

    def visit_Try(self, node):
        self.generic_visit(node)
        if node.finalbody:
            node.finalbody = self.first(node.finalbody, node.finalbody[0])
        return node

    visit_TryStar = visit_Try

    def visit_With(self, node):
        """The point after a `with` block: where the file's code goes on when the context's exit swallowed an exception
        (`contextlib.suppress`: a GeneratorExit thrown in at a yield inside, where torch frees a generator)."""
        self.generic_visit(node)
        return [node, ast.copy_location(ast.Expr(self.here(node)), node)]

    visit_AsyncWith = visit_With

    def resumed(self, node):
        self.generic_visit(node)
        return ast.copy_location(ast.Call(ast.Name(_BACK, ast.Load()), [node], []), node)

    visit_Yield = visit_YieldFrom = visit_Await = resumed

    def comprehension(self, node):
        self.generic_visit(node)
        if isinstance(node, ast.DictComp):
            node.key = self.before(node.key)
        else:
            node.elt = self.before(node.elt)
        for generator in node.generators:
            generator.ifs = [self.before(condition) for condition in generator.ifs]
        return node

    visit_GeneratorExp = visit_ListComp = visit_SetComp = visit_DictComp = comprehension


def _guarded_code(path: Path):
    """The file's code with its attribute writes through the guard (_GuardStores), and the watcher asked wherever it
    runs (_MarkRuns)."""
    tree = _MarkRuns().visit(_GuardStores().visit(ast.parse(path.read_text(), filename=str(path))))
    # annotations stay text, on purpose and not by impl.py's own future import: evaluated, one hands the file a
    # class as a value where the source check reads an annotation (dataclasses.fields(C)[0].type)
    return compile(ast.fix_missing_locations(tree), str(path), "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)


def fsdp2() -> ModuleType:
    return importlib.import_module("torch.distributed.fsdp")


# A piece of task 1 still unwritten: the skeleton's `raise TodoError("TODO(task1): ...")` statement
# (not the words in a comment or docstring).
_TASK1_UNDONE = re.compile(r"^[ \t]*raise TodoError\([\"']TODO\(task1\)", re.M)


def task1_undone(path: Path) -> bool:
    """Whether the file still raises task 1's TodoError somewhere: it cannot train yet."""
    return bool(_TASK1_UNDONE.search(path.read_text()))


def todo_reached(error: BaseException) -> str | None:
    """The `TODO(...)` a rank stopped at, from the traceback text a RankError carries; None if the
    error is anything else (a real bug, which deserves its traceback)."""
    # The rank's traceback ends `<module>.TodoError: TODO(task1): ...` where the skeleton stopped.
    todo = [m[1] for line in str(error).splitlines() if (m := re.search(r"\bTodoError: (TODO\(.*)$", line))]
    return todo[-1] if todo else None


class FeatureError(RuntimeError):
    """effdl crashed in a way that means it lacks a training feature."""


COMPILE_FIX = ("--compile: torch.compile traced effdl's code into a compiled graph ({where}). A "
               "block compiled in place runs its forward hooks inside the compiled call, but FSDP's collectives, "
               "storage resizes and state changes must run for real on every call: keep the hooks out of the "
               "graph by decorating pre_forward, post_forward, pre_backward, post_backward and final_callback "
               "with @torch.compiler.disable (as FSDP2 and the current fsdp.py do), or drop --compile")


def compile_backend(fsdp: str, impl: str):
    """train.py --compile's torch.compile backend: inductor; for effdl, inductor
    behind a check that no graph holds code of its file (its hooks must stay out of the graphs)."""
    if fsdp != "effdl":
        return "inductor"
    path = str(impl_path(impl))

    def inductor_without_fsdp_code(gm, example_inputs):
        for node in gm.graph.nodes:
            # A node's stack trace: the lines `File "...", line N, in fn` of the frames it came from.
            frames = re.findall(rf'File "{re.escape(path)}", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
            if frames:
                line, fn = frames[0]
                raise FeatureError(COMPILE_FIX.format(where=f"{fn}, line {line}"))
        import torch._dynamo

        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)

    return inductor_without_fsdp_code


def _handwritten_files() -> list[str]:
    return [m.__file__ for name, m in list(sys.modules.items()) if name.startswith(FILE_MODULES)]


def explain_errors(fn, *args):
    """Run `fn(*args)`; a crash that means the FSDP under test lacks a feature train.py uses
    (activation checkpointing, meta-device init, torch.compile) is re-raised saying what is
    missing and why."""
    try:
        return fn(*args)
    except RuntimeError as e:
        msg = str(e)
        if type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
            # A backend's own error comes wrapped (BackendCompilerFailed); one the check above raised
            # is already the explanation.
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, FeatureError):
                raise inner from None
            traced = [f for f in _handwritten_files() if f in msg]
            if traced:
                raise FeatureError(COMPILE_FIX.format(where=f"compiling it failed: {msg.splitlines()[0]}")
) from e
        if "setStorage" in msg or "out of bounds for storage" in msg:
            raise FeatureError(
                "the FSDP freed parameters that backward still uses. With activation checkpointing "
                "(--activation-checkpoint full, or torch.utils.checkpoint around an FSDP module) backward "
                "recomputes the block's forward, running its forward hooks again while its TrainingState is "
                "PRE_BACKWARD: pre_forward must then only make sure the parameters are gathered and post_forward "
                "must not reshard them (post-backward does), as FSDP2 does. Original error: "
                + msg.splitlines()[0]) from e
        if "no longer uses the storage FSDP gathers" in msg:
            raise FeatureError(
                "meta-device init (train.py's default) calls model.to_empty() after fully_shard, which gives "
                "every sharded parameter new storage; the FSDP must follow it (re-point its padded shard at the "
                "new local tensor, as FSDP2's FSDPModule._apply does) or train with --no-meta-init. Original "
                "error: " + msg.splitlines()[0]) from e
        raise


def turn_off_prefetch(model, name: str) -> None:
    """`train.py --no-prefetch`: effdl gathers each group only when it runs."""
    if not hasattr(model, "set_prefetch"):
        raise ConfigError(f"--no-prefetch: {impl_path(name)} has no FSDPModule.set_prefetch; "
                          "copy it (and FSDPGroup.prefetch, which the prefetches call) from the current fsdp.py")
    model.set_prefetch(False)
