"""cp-equivalence and the context-parallel vision-attention modes on CPU processes (gloo).

The 2-process and the 4-process groups are spawned once each (module fixtures) and run every
request of their size; the tests read the results. Faults are planted through the probes'
test-only parameters (zero thresholds, a vision attention that communicates), in the same
process groups.
"""

from __future__ import annotations

import pytest
import torch

from magistral_cli.probes.cp_equivalence import (
    THRESHOLDS,
    cp_equivalence_request,
    evaluate,
    run_cp_equivalence_probe,
)
from magistral_cli.probes.cp_workers import check_cp_nproc, merge_rank_cases, run_cp_requests
from magistral_cli.probes.vision_attention import run_vision_attention_probe, vision_cp_request

ZERO = {dtype: dict.fromkeys(limits, 0.0) for dtype, limits in THRESHOLDS.items()}
TWO = {
    "equivalence-ulysses": cp_equivalence_request("ulysses"),
    "equivalence-ring-chunk": cp_equivalence_request("ring", chunk_loss=True),
    "equivalence-ring-zero": cp_equivalence_request("ring", dtypes=["fp32"], thresholds=ZERO),
    "vision-ulysses": vision_cp_request("ulysses"),
    "vision-ring": vision_cp_request("ring"),
    "vision-ulysses-communicates": vision_cp_request("ulysses", inject="vision-uses-cp-attention"),
}
FOUR = {
    "equivalence-hybrid": cp_equivalence_request("hybrid"),
    "vision-hybrid": vision_cp_request("hybrid"),
}


def _run(requests: dict) -> dict:
    results = run_cp_requests("cpu", list(requests.values()))
    return {name: r.to_json() for name, r in zip(requests, results, strict=True)}


@pytest.fixture(scope="module")
def two():
    return _run(TWO)


@pytest.fixture(scope="module")
def four():
    return _run(FOUR)


def _equivalence_passes(result, mode, nproc, chunk_loss=False):
    assert (result["probe"], result["mode"], result["result"]) == ("cp-equivalence", mode, "PASS"), result
    cases = {c["name"]: c for c in result["cases"]}
    for dtype in ("fp32", "bf16"):
        for measure in ("loss relative error", "gradient relative L2", "SGD update relative L2"):
            case = cases[f"{dtype} {measure}"]
            assert case["result"] == "PASS" and case["processes"] == nproc, case
            assert 0 <= case["value"] < case["threshold"] == THRESHOLDS[dtype][case_key(measure)], case
        vision = cases[f"{dtype} vision tower makes no CP communication"]
        assert vision["vision_cp_communications"] == 0 and vision["decoder_cp_communications"] > 0, vision
    assert len(cases) == 8
    assert f"{mode} training step on {nproc} processes" in result["reason"]
    assert ("chunked loss" in result["reason"]) == chunk_loss


def case_key(measure: str) -> str:
    return {
        "loss relative error": "loss_relative_error",
        "gradient relative L2": "gradient_relative_l2",
        "SGD update relative L2": "update_relative_l2",
    }[measure]


@pytest.mark.slow
def test_ulysses_step_equals_cp1_on_two_processes(two):
    _equivalence_passes(two["equivalence-ulysses"], "ulysses", 2)


@pytest.mark.slow
def test_ring_step_with_chunked_loss_equals_cp1_on_two_processes(two):
    _equivalence_passes(two["equivalence-ring-chunk"], "ring", 2, chunk_loss=True)
    fp32 = next(c for c in two["equivalence-ring-chunk"]["cases"] if c["name"] == "fp32 gradient relative L2")
    assert fp32["value"] < 1e-5  # far below the threshold: a wrong reduction would be off by 50%+


@pytest.mark.slow
def test_hybrid_step_equals_cp1_on_four_processes(four):
    _equivalence_passes(four["equivalence-hybrid"], "hybrid", 4)


@pytest.mark.slow
def test_zero_thresholds_fail_every_measure(two):
    result = two["equivalence-ring-zero"]
    assert result["result"] == "FAIL"
    failed = sorted(c["name"] for c in result["cases"] if c["result"] == "FAIL")
    assert failed == ["fp32 SGD update relative L2", "fp32 gradient relative L2", "fp32 loss relative error"]
    assert ">= 0" in result["reason"]


def _vision_passes(result, mode, nproc):
    assert (result["probe"], result["mode"], result["result"]) == ("vision-attention", mode, "PASS"), result
    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases)[0] == "context-parallel group" and list(cases)[-1] == "replicated outputs"
    assert len(cases) == 7 and all(c["ranks"] == nproc for c in cases.values())
    numerics = [c for n, c in cases.items() if n.startswith(("numerics", "isolation"))]
    assert len(numerics) == 5 and all(c["vision_cp_communications"] == 0 for c in numerics)
    unequal = cases["numerics 2 image(s) [[16, 16], [16, 24]]"]
    assert unequal["boundaries"] == [64, 160]
    assert 0 < unequal["forward_relative_l2"] <= 0.015 and unequal["max_gradient_relative_l2"] <= 0.04
    assert cases["replicated outputs"]["identical_on_ranks"] == nproc
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_vision_attention_passes_in_a_two_process_cp_group(two, mode):
    cases = _vision_passes(two[f"vision-{mode}"], mode, 2)
    group = cases["context-parallel group"]
    assert (group["ulysses_size"], group["ring_size"]) == ((2, 1) if mode == "ulysses" else (1, 2))


@pytest.mark.slow
def test_vision_attention_passes_in_the_hybrid_cp_group(four):
    cases = _vision_passes(four["vision-hybrid"], "hybrid", 4)
    assert (
        cases["context-parallel group"]["ulysses_size"],
        cases["context-parallel group"]["ring_size"],
    ) == (2, 2)


@pytest.mark.slow
def test_a_vision_tower_that_communicates_fails(two):
    result = two["vision-ulysses-communicates"]
    assert result["result"] == "FAIL"
    cases = {c["name"]: c for c in result["cases"]}
    assert cases["context-parallel group"]["result"] == "PASS"
    for name, case in cases.items():
        if name.startswith(("numerics", "isolation")):
            assert case["result"] == "FAIL" and case["failed_ranks"] == [0, 1], case
            assert (
                "context-parallel communication (ulysses all_to_all) inside the vision tower" in case["error"]
            )


# --------------------------------------------------------------------------- without processes


def _run_record(**overrides):
    record = {
        "loss": 6.2,
        "reference_loss": 6.2,
        "loss_relative_error": 1e-7,
        "gradient_relative_l2": 1e-7,
        "update_relative_l2": 1e-6,
        "vision_runs": 2,
        "vision_cp_communications": 0,
        "cp_communications": 9,
        "vision_gradient_relative_l2": 1e-7,
        "ulysses_size": 1,
        "ring_size": 2,
    }
    return {**record, **overrides}


@pytest.mark.parametrize(
    ("rank1", "message"),
    [
        ({}, None),
        ({"vision_cp_communications": 3}, "rank 1: the vision tower made 3 CP communications"),
        ({"vision_runs": 0}, "rank 1: the vision tower and projector ran 0 times"),
        ({"cp_communications": 0}, "rank 1: the decoder made no CP communication"),
        ({"loss": 6.3}, "the ranks report different combined losses"),
        ({"gradient_relative_l2": float("nan")}, "gradient relative L2 nan >= 0.0001"),
        ({"update_relative_l2": 2e-4}, "SGD update relative L2 0.0002 >= 0.0001"),
        ({"error": "ContextParallelError: boom"}, "rank 1: ContextParallelError: boom"),
    ],
)
def test_each_equivalence_check_can_fail(rank1, message):
    request = cp_equivalence_request("ring", dtypes=["fp32"])
    per_rank = [{"runs": [_run_record()]}, {"runs": [_run_record(**rank1)]}]
    result = evaluate(request, "cpu", per_rank).to_json()
    if message is None:
        assert result["result"] == "PASS" and len(result["cases"]) == 4, result
    else:
        assert result["result"] == "FAIL" and message in result["reason"], result


def test_merged_cases_pass_only_when_every_rank_passed():
    ranks = [
        [{"name": "a", "result": "PASS", "x": 0.1, "sizes": [1]}, {"name": "b", "result": "PASS"}],
        [
            {"name": "a", "result": "PASS", "x": 0.3, "sizes": [1]},
            {"name": "b", "result": "FAIL", "error": "no"},
        ],
    ]
    merged = merge_rank_cases(ranks)
    assert merged[0] == {"name": "a", "x": 0.3, "sizes": [1], "ranks": 2, "result": "PASS"}
    assert (
        merged[1]["result"] == "FAIL"
        and merged[1]["error"] == "rank 1: no"
        and merged[1]["failed_ranks"] == [1]
    )
    with pytest.raises(ValueError, match="rank 1 ran cases"):
        merge_rank_cases([ranks[0], ranks[1][:1]])


def test_process_counts_that_cannot_run_a_mode():
    assert check_cp_nproc("ring", 2) is None and check_cp_nproc("hybrid", 4) is None
    assert "at least 2 processes" in check_cp_nproc("ulysses", 1)
    assert "hybrid needs an even number" in check_cp_nproc("hybrid", 2)
    assert "hybrid needs an even number" in check_cp_nproc("hybrid", 5)
    assert check_cp_nproc("hybrid", 6) is None
    with pytest.raises(ValueError, match="hybrid needs"):
        run_cp_equivalence_probe("cpu", "hybrid", nproc=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("probe", ["cp-equivalence", "vision-attention"])
def test_a_missing_device_skips_with_the_reason(probe):
    if probe == "cp-equivalence":
        result = run_cp_equivalence_probe("cuda", "ring").to_json()
    else:
        result = run_vision_attention_probe("cuda", "hybrid").to_json()
    assert (result["result"], result["cases"]) == ("SKIP", []) and "no CUDA device" in result["reason"]
    assert result["skip_kind"] == "no_device"


@pytest.mark.slow
def test_a_process_group_past_its_time_is_stopped():
    from magistral_cli.probes.cp_equivalence import run_rank_job
    from magistral_cli.probes.cp_workers import spawn_rank_jobs

    # The probe's real job (about 3 s on 2 cores), stopped at 0.1 s. It once lacked two arguments
    # and failed at once, so the group sometimes ended inside the first second's wait and returned.
    job = {"run": run_rank_job, "mode": "ring", "dtypes": ["float32"], "chunk_loss": False}
    with pytest.raises(TimeoutError, match="ran past 0.1 s"):
        spawn_rank_jobs("cpu", 2, [job], timeout_s=0.1)
