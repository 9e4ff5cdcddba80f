"""The one-device example: the fusion definitions build and print on any machine, and every
output it checks agrees with torch SDPA (on a GPU the fusions run; here, the reference
kernel that CPU ranks run). Run: pytest -q tests/test_examples.py"""

from __future__ import annotations

from examples.fusion_definitions import TOLERANCE, run


def test_fusion_definitions_example_builds_prints_and_checks():
    printed = []
    result = run(show=printed.append)
    names = [text.split("\n")[0] for text in printed]
    assert names == ["--- SdpaForward", "--- SdpaBackward", "--- SdpaForwardBackward",
                     "--- SdpaForward (half the keys, no mask)", "--- LseMerge"]
    assert "fd.ops.sdpfa_fwd(" in printed[0] and "fd.ops.sdpfa_bwd(" in printed[1]
    assert all("with FusionDefinition() as fd:" in text for text in printed)
    errors = result["errors"]
    assert {"out", "lse", "dq", "dk", "dv", "merged halves"} <= set(errors)
    assert max(errors.values()) < TOLERANCE[result["dtype"]], errors
