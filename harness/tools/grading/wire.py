"""What a rank that ran a file under test sends back: data, never objects.

The grader unpickles nothing such a rank made (unpickling runs whatever the bytes name). A job's
result crosses as one message: JSON for the structure, safetensors for the tensors (a format that
holds only names, dtypes, shapes and bytes), decoded against the job's declared return type on the
grader's side, the only schema there is:

    message = len(header) as 8 bytes little-endian | header (JSON) | safetensors bytes
    header  = {"job": N, "status": "ok" | "error" | "ready", "value": ..., "traceback": "..."}

A value is encoded by its type: None, bool, int, float, str as themselves (a Path as its text);
list[X] and tuple[...] as arrays; dict[str, X] as an object; a dataclass as an object with exactly
its fields; a torch.Tensor as {"tensor": "<name>"}, the name of one safetensors entry, each used
once. `decode` accepts nothing else: a wrong type, a missing or extra field, a string or message
over its size, a tensor named twice or never raises Malformed, naming what was wrong and where.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
import typing
from pathlib import Path
from typing import Any

MAX_MESSAGE = 512 * 2**20
"""bytes of one rank's message (a run's digests and losses take kilobytes, a shard megabytes)"""
MAX_STRING = 2**20
MAX_TRACEBACK = 64 * 2**10
"""characters of a rank's traceback kept (its end, where the error is)"""


class Malformed(ValueError):
    """A rank's message is not a result of the job's declared type; the text says what is wrong."""


def result_type(fn) -> Any:
    """The type `fn`'s result is decoded as: its return annotation, which every job run on ranks
    of a file under test must have (the grader reads nothing it did not declare)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise TypeError(f"{fn.__qualname__}: its annotations cannot be resolved ({e})") from None
    if "return" not in hints:
        raise TypeError(f"{fn.__module__}.{fn.__qualname__} has no return annotation: a job run on the ranks of a "
                        "file under test returns data of a declared type (see harness/tools/grading/wire.py)")
    return hints["return"]


def _none_or(tp: Any) -> tuple[bool, Any]:
    """(whether None is allowed, the other type) of X | None; X alone -> (False, X)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{tp}: only X | None unions can be sent")
        return True, args[0]
    return False, tp


# --------------------------------------------------------------------------- encoding (on the rank)


def _encode(value: Any, tp: Any, tensors: dict, where: str) -> Any:
    import torch

    optional, tp = _none_or(tp)
    if value is None:
        if optional or tp is type(None) or tp is None:
            return None
        raise TypeError(f"{where}: None where {tp} is declared")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool or tp is str or tp is int:
        if type(value) is not tp:
            raise TypeError(f"{where}: {type(value).__name__} where {tp.__name__} is declared")
        return value
    if tp is float:
        if type(value) not in (float, int):
            raise TypeError(f"{where}: {type(value).__name__} where float is declared")
        return float(value)
    if tp is Path or (isinstance(tp, type) and issubclass(tp, Path)):
        return str(value)
    if tp is torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {type(value).__name__} where a tensor is declared")
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {"tensor": name}
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{where}: {type(value).__name__} where a {tp} is declared")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise TypeError(f"{where}: {len(value)} items where {tp} is declared")
            return [_encode(v, a, tensors, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        if not args:
            raise TypeError(f"{where}: {tp} says nothing of its items: declare list[X]")
        return [_encode(v, args[0], tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or args[0] is not str:
            raise TypeError(f"{where}: {type(value).__name__} where {tp} (string keys) is declared")
        return {k: _encode(v, args[1], tensors, f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            raise TypeError(f"{where}: {type(value).__name__} where {tp.__name__} is declared")
        hints = typing.get_type_hints(tp)
        return {f.name: _encode(getattr(value, f.name), hints[f.name], tensors, f"{where}.{f.name}")
                for f in dataclasses.fields(tp)}
    raise TypeError(f"{where}: {tp} cannot be sent as data (declare plain types, dataclasses and tensors)")


def encode(job: int, status: str, value: Any = None, tp: Any = None, traceback: str = "") -> bytes:
    """One rank's message: job number, status and, for "ok", the value encoded as `tp`."""
    from safetensors.torch import save

    tensors: dict = {}
    body = _encode(value, tp, tensors, "result") if status == "ok" else None
    header = json.dumps({"job": job, "status": status, "value": body,
                         "traceback": traceback[-MAX_TRACEBACK:]}).encode()
    return struct.pack("<Q", len(header)) + header + (save(tensors) if tensors else b"")


# --------------------------------------------------------------------------- decoding (in the grader)


def _decode(value: Any, tp: Any, tensors: dict, used: set, where: str) -> Any:
    import torch

    optional, tp = _none_or(tp)
    if value is None:
        if optional or tp is type(None) or tp is None:
            return None
        raise Malformed(f"{where} is null, not {getattr(tp, '__name__', tp)}")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        if type(value) is not bool:
            raise Malformed(f"{where} is {type(value).__name__}, not bool")
        return value
    if tp is int:
        if type(value) is not int:
            raise Malformed(f"{where} is {type(value).__name__}, not int")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise Malformed(f"{where} is {type(value).__name__}, not float")
        return float(value)
    if tp is str or tp is Path or (isinstance(tp, type) and issubclass(tp, Path)):
        if type(value) is not str:
            raise Malformed(f"{where} is {type(value).__name__}, not text")
        if len(value) > MAX_STRING:
            raise Malformed(f"{where} is {len(value)} characters long (at most {MAX_STRING})")
        return value if tp is str else Path(value)
    if tp is torch.Tensor:
        if type(value) is not dict or set(value) != {"tensor"} or type(value["tensor"]) is not str:
            raise Malformed(f"{where} is not a tensor reference")
        name = value["tensor"]
        if name not in tensors or name in used:
            raise Malformed(f"{where} names tensor {name[:40]!r}, which is {'used twice' if name in used else 'not sent'}")
        used.add(name)
        return tensors[name]
    if origin in (list, tuple):
        if type(value) is not list:
            raise Malformed(f"{where} is {type(value).__name__}, not a list")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise Malformed(f"{where} has {len(value)} items, not {len(args)}")
            return tuple(_decode(v, a, tensors, used, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = [_decode(v, args[0], tensors, used, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if type(value) is not dict:
            raise Malformed(f"{where} is {type(value).__name__}, not an object")
        return {k: _decode(v, args[1], tensors, used, f"{where}[{k[:40]!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            raise Malformed(f"{where} is {type(value).__name__}, not a {tp.__name__}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        if set(value) != set(names):
            extra, missing = sorted(set(value) - set(names)), sorted(set(names) - set(value))
            raise Malformed(f"{where} is not a {tp.__name__}: " + "; ".join(
                ([f"unknown fields {[n[:40] for n in extra[:5]]}"] if extra else []) +
                ([f"missing fields {missing}"] if missing else [])))
        return tp(**{n: _decode(value[n], hints[n], tensors, used, f"{where}.{n}") for n in names})
    raise Malformed(f"{where}: {tp} is not a type a rank can send")


def decode(data: bytes, tp: Any) -> tuple[int, str, Any, str]:
    """(job number, status, value decoded as `tp`, traceback) of one rank's message; Malformed if it
    is not one."""
    from safetensors.torch import load

    if len(data) > MAX_MESSAGE:
        raise Malformed(f"the message is {len(data)} bytes (at most {MAX_MESSAGE})")
    if len(data) < 8:
        raise Malformed("the message is shorter than its header's length")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise Malformed("the message's header runs past its end")
    try:
        header = json.loads(data[8:8 + size])
    except (ValueError, RecursionError) as e:
        raise Malformed(f"the header is not JSON ({type(e).__name__})") from None
    if type(header) is not dict or set(header) != {"job", "status", "value", "traceback"}:
        raise Malformed("the header is not {job, status, value, traceback}")
    job, status, tb = header["job"], header["status"], header["traceback"]
    if type(job) is not int or status not in ("ok", "error", "ready") or type(tb) is not str:
        raise Malformed("the header's job, status or traceback has the wrong type")
    rest = data[8 + size:]
    try:
        tensors = load(rest) if rest else {}
    except Exception as e:
        raise Malformed(f"the tensors are not safetensors ({type(e).__name__}: {str(e)[:200]})") from None
    used: set = set()
    try:
        value = _decode(header["value"], tp, tensors, used, "result") if status == "ok" else None
    except RecursionError:
        raise Malformed("the result is nested too deeply") from None
    if set(tensors) - used:
        raise Malformed(f"{len(set(tensors) - used)} tensors were sent that the result does not name")
    return job, status, value, tb[-MAX_TRACEBACK:]
