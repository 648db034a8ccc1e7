"""The load generator: unit tests on crafted data, then short runs against the real stories260K mesh."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import jsonschema
import pytest

from services.cli.loadgen.distribution import LengthDistribution, parse_distribution
from services.cli.loadgen.record import OK, RequestRecord
from services.cli.loadgen.report import LevelResult, level_verdicts, report_json, report_markdown
from services.cli.loadgen.runner import LevelSpec, RequestSource
from services.cli.loadgen.schedule import poisson_offsets, rescale_trace
from services.cli.loadgen.sla import FAIL, NO_DATA, PASS, Sla, find_knee, parse_sla_flag
from services.cli.loadgen.stats import percentile, summarize_latency, summarize_level
from services.cli.loadgen.workload import build_workload, load_trace, load_workload_file, parse_mix
from services.cli.main import main
from services.cli.mesh import Mesh
from services.gateway.tokens import mint_token

SCHEMA = json.loads((Path(__file__).parents[2] / "services/cli/loadgen_schema.json").read_text())
KNOWN_INTENTS = set(
    json.loads((Path(__file__).parents[2] / "deploy/gateway/intents.json").read_text())["intents"]
)


def ok(intent: str, e2e_s: float, ttft_s: float = 0.1, num_output_tokens: int = 11) -> RequestRecord:
    return RequestRecord(intent, OK, 0.0, e2e_s, ttft_s=ttft_s, num_output_tokens=num_output_tokens)


def failed(intent: str, status: str) -> RequestRecord:
    return RequestRecord(intent, status, 0.0, 0.01, error=f"{status} for a test")


# --- arrivals


def test_poisson_offsets_have_the_asked_rate_and_count() -> None:
    offsets = poisson_offsets(4.0, random.Random(7), num_requests=20_000)
    assert len(offsets) == 20_000
    assert all(b > a for a, b in itertools.pairwise(offsets))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    mean_gap = sum(gaps) / len(gaps)
    assert mean_gap == pytest.approx(0.25, rel=0.03)
    # exponential gaps: the standard deviation equals the mean (a fixed-interval schedule would give 0)
    std_gap = (sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std_gap == pytest.approx(mean_gap, rel=0.05)


def test_poisson_offsets_by_duration_stay_inside_it_and_repeat_with_the_seed() -> None:
    offsets = poisson_offsets(10.0, random.Random(1), duration_s=50.0)
    assert offsets[-1] < 50.0 and len(offsets) == pytest.approx(500, rel=0.15)
    assert offsets == poisson_offsets(10.0, random.Random(1), duration_s=50.0)
    with pytest.raises(ValueError, match="exactly one"):
        poisson_offsets(1.0, random.Random(1))
    with pytest.raises(ValueError, match="> 0"):
        poisson_offsets(0.0, random.Random(1), num_requests=3)


def test_levels_send_the_same_requests_faster_at_a_higher_rate() -> None:
    workload = build_workload(None, {"medical-diagnosis": 0.7, "code-completion": 0.2, "default": 0.1})
    slow = RequestSource(LevelSpec("open", 0.5, duration_s=60.0), workload, None, seed=9).open_loop_plan()
    fast = RequestSource(LevelSpec("open", 2.0, duration_s=60.0), workload, None, seed=9).open_loop_plan()
    assert len(fast) > len(slow) > 0  # more arrivals in the same minute, never fewer
    for a, b in zip(slow, fast, strict=False):
        assert (a.intent, a.prompt, a.max_tokens) == (b.intent, b.prompt, b.max_tokens)
        assert b.offset_s == pytest.approx(a.offset_s / 4)


def test_a_trace_is_rescaled_to_the_asked_rate(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"offset_s": 0.0, "intent": "default", "prompt": "hello there", "max_tokens": 4},
        {"offset_s": 2.0, "intent": "code-completion", "prompt_tokens": 5, "max_tokens": 8},
        {"offset_s": 1.0, "prompt": "unsorted line", "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    trace = load_trace(path, random.Random(0))
    assert [r.offset_s for r in trace] == [0.0, 1.0, 2.0]
    assert trace[2].intent == "code-completion" and len(trace[2].prompt.split()) == 5
    assert [r.offset_s for r in rescale_trace(trace, 4.0)] == [
        0.0,
        0.25,
        0.5,
    ]  # 3 requests over 2 s = 1 req/s


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"offset_s": 0, "max_tokens": 4}', "exactly one of 'prompt'"),
        ('{"offset_s": -1, "prompt": "x", "max_tokens": 4}', "'offset_s'"),
        ('{"offset_s": 0, "prompt": "x", "max_tokens": 0}', "'max_tokens'"),
        ('{"offset_s": 0, "prompt": "x", "max_tokens": 4, "colour": 1}', "unknown keys"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as caught:
        load_trace(path, random.Random(0))
    assert f"{path}:1" in str(caught.value)


# --- the mix and the workload file


def test_parse_mix_reads_ratios_and_the_workload_normalises_them() -> None:
    mix = parse_mix("medical-diagnosis=0.7, code-completion=0.2,default=0.1")
    assert mix == {"medical-diagnosis": 0.7, "code-completion": 0.2, "default": 0.1}
    assert set(mix) <= KNOWN_INTENTS
    shares = build_workload(None, parse_mix("default=3,batch=1")).shares
    assert shares == {"default": 0.75, "batch": 0.25}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("default", "not INTENT=RATIO"),
        ("=0.5", "not INTENT=RATIO"),
        ("default=half", "not a number"),
        ("default=-1", ">= 0"),
        ("default=0.5,default=0.5", "twice"),
        ("default=0,batch=0", "no ratio above 0"),
    ],
)
def test_parse_mix_rejects_bad_items(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mix(text)


def test_draws_follow_the_mix_and_each_class_keeps_its_lengths() -> None:
    workload = build_workload(None, {"medical-diagnosis": 0.7, "code-completion": 0.2, "default": 0.1})
    rng = random.Random(3)
    draws = [workload.draw(rng) for _ in range(5000)]
    share = sum(d.intent == "medical-diagnosis" for d in draws) / len(draws)
    assert share == pytest.approx(0.7, abs=0.03)
    code = [d for d in draws if d.intent == "code-completion"]
    assert all(8 <= d.max_tokens <= 32 for d in code)
    assert all(16 <= len(d.prompt.split()) <= 512 for d in code)


def test_workload_file_sets_lengths_weights_and_slas(tmp_path: Path) -> None:
    path = tmp_path / "workload.toml"
    path.write_text(
        "[class.medical-diagnosis]\nweight = 3\n"
        'prompt_tokens = { dist = "normal", mean = 50, std = 5, min = 40, max = 60 }\n'
        'output_tokens = { dist = "constant", value = 12 }\n'
        "sla = { ttft_ms = 800, e2e_ms = 4000 }\n"
        "[class.default]\nweight = 1\n"
    )
    workload = build_workload(load_workload_file(path), None, dict([parse_sla_flag("default:e2e_ms=9000")]))
    assert workload.shares == {"medical-diagnosis": 0.75, "default": 0.25}
    assert workload.slas["medical-diagnosis"] == Sla(ttft_ms=800, e2e_ms=4000)
    assert workload.slas["default"] == Sla(e2e_ms=9000)
    medical = workload.classes[0]
    rng = random.Random(0)
    assert all(40 <= medical.prompt_tokens.sample(rng) <= 60 for _ in range(200))
    assert medical.draw(rng).max_tokens == 12


def test_workload_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "workload.toml"
    path.write_text('[class.default]\nprompt_tokens = { dist = "zipf", s = 1 }\n')
    with pytest.raises(ValueError, match=r"\[class.default\] prompt_tokens: 'dist' must be one of"):
        load_workload_file(path)
    with pytest.raises(ValueError, match="needs key 'std'"):
        parse_distribution({"dist": "normal", "mean": 3}, "here")
    with pytest.raises(ValueError, match="not in the mix"):
        build_workload(None, {"default": 1.0}, {"batch": Sla(e2e_ms=1)})


def test_lognormal_lengths_are_clamped_and_centred_on_the_median() -> None:
    lengths = LengthDistribution("lognormal", 100, 0.5, min_tokens=20, max_tokens=300)
    rng = random.Random(5)
    draws = sorted(lengths.sample(rng) for _ in range(4001))
    assert draws[0] >= 20 and draws[-1] <= 300
    assert draws[2000] == pytest.approx(100, rel=0.05)


# --- percentiles, summaries, SLAs and the knee


def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    summary = summarize_latency([v / 1000 for v in values])
    assert summary is not None and summary.count == 100 and summary.mean_ms == pytest.approx(50.5)
    assert summarize_latency([]) is None


def test_level_summary_counts_add_up_and_tpot_skips_one_token_answers() -> None:
    records = [
        ok("default", 1.1, ttft_s=0.1, num_output_tokens=11),  # tpot (1.1 - 0.1) / 10 = 100 ms
        ok("default", 0.5, ttft_s=0.5, num_output_tokens=1),  # no tpot
        failed("default", "RESOURCE_EXHAUSTED"),
        failed("batch", "DEADLINE_EXCEEDED"),
        failed("batch", "DEADLINE_EXCEEDED"),
    ]
    level = summarize_level(records, wall_s=2.0, intents=["default", "batch", "code-completion"])
    overall, default = level.overall, level.classes["default"]
    assert (overall.num_sent, overall.num_succeeded) == (5, 2)
    assert overall.failed_by_status == {"DEADLINE_EXCEEDED": 2, "RESOURCE_EXHAUSTED": 1}
    assert overall.num_sent == overall.num_succeeded + overall.num_failed
    assert default.tpot is not None and default.tpot.count == 1 and default.tpot.p50_ms == pytest.approx(100)
    assert default.requests_per_s == pytest.approx(1.0) and default.output_tokens_per_s == pytest.approx(6.0)
    assert level.classes["code-completion"].num_sent == 0
    assert level.classes["batch"].first_errors == {"DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED for a test"}


def test_sla_verdicts_cover_latency_errors_and_missing_data() -> None:
    sla = Sla(ttft_ms=200, e2e_ms=1000, max_error_rate=0.1)
    fast = summarize_level([ok("a", 0.5, ttft_s=0.1) for _ in range(20)], 10.0, ["a", "b"])
    assert sla.check(fast.classes["a"]).status == PASS
    assert sla.check(fast.classes["b"]).status == NO_DATA
    slow = summarize_level([ok("a", 0.5, ttft_s=0.1)] * 19 + [ok("a", 3.0, ttft_s=0.1)], 10.0, ["a"])
    verdict = sla.check(slow.classes["a"])
    assert verdict.status == FAIL and verdict.reasons[0].startswith("e2e p99")
    flaky = summarize_level([ok("a", 0.5)] * 8 + [failed("a", "UNAVAILABLE")] * 2, 10.0, ["a"])
    assert sla.check(flaky.classes["a"]).reasons == ("error rate 0.200 > 0.100",)
    with pytest.raises(ValueError, match="at least one"):
        Sla()
    with pytest.raises(ValueError, match="not INTENT:KEY=MS"):
        parse_sla_flag("default")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_sla_flag("default:p99=3")


@pytest.mark.parametrize(
    ("statuses", "knee"),
    [
        ([PASS, PASS, PASS, FAIL], 4.0),
        ([PASS, PASS, PASS, PASS], 8.0),
        ([FAIL, PASS, PASS, PASS], None),
        ([PASS, FAIL, PASS, FAIL], 1.0),  # a pass above a failure is not headroom
        ([PASS, NO_DATA, PASS, FAIL], 4.0),
        ([NO_DATA, NO_DATA, NO_DATA, NO_DATA], None),
    ],
)
def test_knee_is_the_last_pass_before_the_first_failure(statuses: list[str], knee: float | None) -> None:
    assert find_knee([1.0, 2.0, 4.0, 8.0], statuses) == knee
    assert find_knee([8.0, 4.0, 2.0, 1.0], statuses[::-1]) == knee  # order of the input does not matter


def test_a_crafted_sweep_reports_each_class_knee_and_validates() -> None:
    slas = {"fast": Sla(e2e_ms=1000), "slow": Sla(ttft_ms=300, max_error_rate=0.5)}
    levels = []
    for load, e2e_s, ttft_s in [(1.0, 0.4, 0.1), (2.0, 0.8, 0.2), (4.0, 2.0, 0.5)]:
        records = [ok("fast", e2e_s), ok("slow", e2e_s, ttft_s=ttft_s), failed("slow", "UNAVAILABLE")]
        summary = summarize_level(records, 10.0, ["fast", "slow"])
        levels.append(LevelResult("open", load, summary, level_verdicts(summary, slas)))
    settings = {"started_at": "x", "target": "t", "mode": "open", "loads": [1, 2, 4], "source": "mix"}
    settings |= {"classes": {}, "seed": 0, "timeout_s": 1.0, "warmup_requests": 0}
    document = report_json(settings, levels, slas)
    jsonschema.validate(document, SCHEMA)
    assert document["knees"] == {"fast": 2.0, "slow": 2.0}
    markdown = report_markdown(levels, slas)
    assert "| slow | ttft ≤ 300 ms, errors ≤ 0.5 | 2 |" in markdown
    assert "UNAVAILABLE 1" in markdown


# --- against the real mesh


def assert_counts_add_up(summary: dict) -> None:
    assert summary["sent"] == summary["succeeded"] + sum(summary["failed_by_status"].values())
    assert summary["failed"] == sum(summary["failed_by_status"].values())


def test_open_loop_run_through_the_mesh_counts_every_request(stories_mesh: Mesh, tmp_path: Path) -> None:
    token = mint_token(stories_mesh.private_key_path.read_bytes(), subject="loadgen", tenant="loadgen-open")
    out = tmp_path / "run.json"
    # "no-such-intent" is refused by the gateway: the failures must show up by status, not vanish
    code = main([
        "loadgen", "--target", stories_mesh.target("gateway"), "--token", token, "--no-progress",
        "--mix", "medical-diagnosis=0.4,code-completion=0.3,default=0.2,no-such-intent=0.1",
        "--rate", "8", "--num-requests", "24", "--prompt-tokens", "6", "--output-tokens", "20",
        "--seed", "4", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, SCHEMA)
    (level,) = document["levels"]
    assert level["overall"]["sent"] == 24
    for summary in [level["overall"], *level["classes"].values()]:
        assert_counts_add_up(summary)
    assert sum(c["sent"] for c in level["classes"].values()) == 24
    refused = level["classes"]["no-such-intent"]
    assert refused["sent"] > 0 and refused["failed_by_status"] == {"INVALID_ARGUMENT": refused["sent"]}
    assert "unknown intent 'no-such-intent'" in refused["first_errors"]["INVALID_ARGUMENT"]
    for intent in ("medical-diagnosis", "code-completion", "default"):
        served = level["classes"][intent]
        assert served["failed"] == 0 and served["finish_reasons"] == {"length": served["sent"]}
        assert served["output_tokens"] == 20 * served["sent"]
        assert served["ttft_ms"]["count"] == served["e2e_ms"]["count"] == served["sent"]


def test_closed_loop_sweep_writes_json_markdown_and_plots(stories_mesh: Mesh, tmp_path: Path) -> None:
    token = mint_token(stories_mesh.private_key_path.read_bytes(), subject="loadgen", tenant="loadgen-sweep")
    code = main([
        "loadgen", "--target", stories_mesh.target("gateway"), "--token", token, "--no-progress",
        "--mode", "closed", "--sweep", "2,1", "--num-requests", "6", "--mix", "default=1,code-completion=1",
        "--prompt-tokens", "6", "--output-tokens", "4", "--sla", "default:e2e_ms=600000",
        "--sla", "code-completion:ttft_ms=600000,max_error_rate=0",
        "--json", str(tmp_path / "sweep.json"), "--markdown", str(tmp_path / "sweep.md"),
        "--plots", str(tmp_path / "sweep"),
    ])  # fmt: skip
    assert code == 0
    document = json.loads((tmp_path / "sweep.json").read_text())
    jsonschema.validate(document, SCHEMA)
    assert [level["load"] for level in document["levels"]] == [1.0, 2.0]
    for level in document["levels"]:
        assert level["overall"]["sent"] == 6 and level["overall"]["succeeded"] == 6
        assert set(level["sla"]) == {"default", "code-completion"}
    # limits of ten minutes hold at any speed, so both levels pass and the knee is the top level
    assert document["knees"] == {"default": 2.0, "code-completion": 2.0}
    assert "## Knee" in (tmp_path / "sweep.md").read_text()
    for intent in ("default", "code-completion"):
        png = tmp_path / f"sweep_{intent}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_sla_for_a_class_the_trace_lacks_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"offset_s": 0, "intent": "default", "prompt": "hi", "max_tokens": 2}) + "\n")
    assert main(["loadgen", "--trace", str(trace), "--sla", "medical-diagnosis:e2e_ms=100"]) == 2
    assert "not in the trace: ['medical-diagnosis']" in capsys.readouterr().err


def test_bad_settings_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadgen", "--mix", "default=lots"]) == 2
    assert "not a number" in capsys.readouterr().err
    assert main(["loadgen", "--sweep", "1,fast"]) == 2
    assert "comma-separated list of numbers" in capsys.readouterr().err
    assert main(["loadgen", "--mode", "closed", "--sweep", "1.5"]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_a_trace_replays_at_its_own_pace_through_the_mesh(stories_mesh: Mesh, tmp_path: Path) -> None:
    token = mint_token(stories_mesh.private_key_path.read_bytes(), subject="loadgen", tenant="loadgen-trace")
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"offset_s": 0.0, "intent": "medical-diagnosis", "prompt": "Once upon a time", "max_tokens": 5},
        {"offset_s": 0.2, "intent": "code-completion", "prompt_tokens": 4, "max_tokens": 3},
        {"offset_s": 0.4, "prompt": "The cat", "max_tokens": 2},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "trace.json"
    code = main([
        "loadgen", "--target", stories_mesh.target("gateway"), "--token", token, "--no-progress",
        "--trace", str(trace), "--num-requests", "3", "--warmup", "0", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, SCHEMA)
    (level,) = document["levels"]
    assert level["load"] == pytest.approx(5.0)  # 2 gaps in 0.4 s: the trace's own rate
    assert {intent: c["output_tokens"] for intent, c in level["classes"].items()} == {
        "code-completion": 3,
        "default": 2,
        "medical-diagnosis": 5,
    }
    assert_counts_add_up(level["overall"])
