"""harness.tools.grading.wire: a sandboxed rank's result crosses as data, decoded against the job's declared
type; anything else is refused, saying what was wrong and where."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

import train
from harness.tools.grading import jobs, wire


def run_job() -> jobs.Run: ...


def tensors_job() -> dict[str, list[torch.Tensor]]: ...


RUN = wire.result_type(run_job)


def a_run(**changes) -> jobs.Run:
    fields = dict(result=train.TrainResult([4.09, 3.5], [0.8, 0.7], [], [12]), digests=[{"w": "ab12"}], problems=[],
                  comm=jobs.Comm([(1, "forward", "all_gather", "bfloat16", 4096)], None), uses_fsdp2=None,
                  forward_loss=-0.0)
    return jobs.Run(**{**fields, **changes})


def message(value, job: int = 1, status: str = "ok") -> bytes:
    header = json.dumps({"job": job, "status": status, "value": value, "traceback": ""}).encode()
    return struct.pack("<Q", len(header)) + header


def test_a_run_crosses_exactly():
    run = a_run()
    job, status, back, _ = wire.decode(wire.encode(7, "ok", run, RUN), RUN)
    assert (job, status, back) == (7, "ok", run)
    assert isinstance(back.comm.events[0], tuple) and str(back.forward_loss) == "-0.0"


def test_tensors_cross_bit_for_bit():
    tp = wire.result_type(tensors_job)
    value = {"w": [torch.randn(5, 3), torch.arange(4, dtype=torch.bfloat16), torch.empty(0)]}
    _, _, back, _ = wire.decode(wire.encode(1, "ok", value, tp), tp)
    for a, b in zip(value["w"], back["w"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_traceback_crosses_capped():
    _, status, value, tb = wire.decode(wire.encode(3, "error", traceback="x" * (wire.MAX_TRACEBACK + 10) + "Error: end"),
                                       RUN)
    assert status == "error" and value is None and len(tb) == wire.MAX_TRACEBACK and tb.endswith("Error: end")


def encoded_run() -> dict:
    return json.loads(wire.encode(1, "ok", a_run(), RUN)[8:])["value"]


@pytest.mark.parametrize("change, refusal", [
    (lambda v: v["comm"]["events"][0].__setitem__(4, "4096"), r"result\.comm\.events\[0\]\[4\] is str, not int"),
    (lambda v: v.__setitem__("forward_loss", "4.09"), r"result\.forward_loss is str, not float"),
    (lambda v: v.__setitem__("passed", True), r"result is not a Run: unknown fields \['passed'\]"),
    (lambda v: v.pop("digests"), r"missing fields \['digests'\]"),
    (lambda v: v["result"].__setitem__("losses", {"tensor": "t0"}), r"result\.result\.losses is dict, not a list"),
    (lambda v: v["problems"].append("x" * (wire.MAX_STRING + 1)), r"result\.problems\[0\] is \d+ characters long"),
    (lambda v: v.__setitem__("uses_fsdp2", 0), r"result\.uses_fsdp2 is int, not text"),
    (lambda v: v["comm"]["events"][0].pop(), r"result\.comm\.events\[0\] has 4 items, not 5"),
])
def test_a_malformed_run_is_refused(change, refusal):
    value = encoded_run()
    change(value)
    with pytest.raises(wire.Malformed, match=refusal):
        wire.decode(message(value), RUN)


@pytest.mark.parametrize("data, refusal", [
    (pickle.dumps((1, "ok", None, "")), "header"),  # what an unpickling channel would have taken
    (b"\x00" * 4, "shorter than its header"),
    (struct.pack("<Q", 10**9) + b"{}", "runs past its end"),
    (struct.pack("<Q", 10) + b"[" * 10, "not JSON"),
    (struct.pack("<Q", 2) + b"[]", r"not \{job, status, value, traceback\}"),
    (message(None, status="passed"), "wrong type"),
    (message({"tensor": "t0"}, status="ok") + b"not safetensors", "not safetensors"),
])
def test_a_malformed_message_is_refused(data, refusal):
    with pytest.raises(wire.Malformed, match=refusal):
        wire.decode(data, wire.result_type(tensors_job) if b"tensor" in data else RUN)


def test_tensors_must_be_named_once():
    tp = wire.result_type(tensors_job)
    data = wire.encode(1, "ok", {"w": [torch.ones(2)]}, tp)
    header_size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_size])
    header["value"] = {"w": [{"tensor": "t0"}, {"tensor": "t0"}]}
    twice = json.dumps(header).encode()
    with pytest.raises(wire.Malformed, match="used twice"):
        wire.decode(struct.pack("<Q", len(twice)) + twice + data[8 + header_size:], tp)
    header["value"] = {"w": []}
    unnamed = json.dumps(header).encode()
    with pytest.raises(wire.Malformed, match="1 tensors were sent that the result does not name"):
        wire.decode(struct.pack("<Q", len(unnamed)) + unnamed + data[8 + header_size:], tp)


def test_an_oversized_message_is_refused():
    with pytest.raises(wire.Malformed, match="bytes \\(at most"):
        wire.decode(b"\x00" * (wire.MAX_MESSAGE + 1), RUN)


def test_a_job_without_a_declared_type_cannot_run_in_the_sandbox():
    def job():
        return 1

    with pytest.raises(TypeError, match="has no return annotation"):
        wire.result_type(job)
    with pytest.raises(TypeError, match="str where Run is declared"):
        wire.encode(1, "ok", "passed", RUN)
