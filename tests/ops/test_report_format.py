"""ops/report.py's text: the figures of a run report as `hsd report` and `hsd launch` print them,
and the line that says when neither stage's compute set the pace."""

from ops.report import IDLE_BELOW, format_report


def _report(target_utilization: float, drafter_utilization: float, efficiency: float) -> dict:
    """A finished two-epoch run's report with the given stage figures (the rest as make demo-sim's)."""
    return {"run_dir": "runs/demo-sim", "finished": True, "epochs": 2, "wall_s": 21.1, "restarts": 0,
            "jobs_total": 798, "committed": 798, "duplicates": 0, "lost": 0, "uncommitted": 0, "given_back": {},
            "slots_verified": 798, "witness_models": 2, "witness_trained": 798, "witness_duplicates": 0,
            "witness_missing": 0, "steps": 200, "step_mix": 1.0, "step_mix_at_open": 1.0,
            "mean_buckets_per_step": 1.88, "prefix_deviation": {"schedule": 1.31, "consumed": 1.84},
            "tail_skew": {"schedule": 0.025, "consumed": 0.025},
            "stages": {"target": {"utilization": target_utilization, "tokens_per_s": 265527.0,
                                  "capacity_tokens_per_s": 661641.0},
                       "drafter": {"utilization": drafter_utilization, "tokens_per_s": 265527.0,
                                   "capacity_tokens_per_s": 503339.0}},
            "pipeline_efficiency": efficiency, "reads": {"local": 0, "remote": 0}}


def test_a_run_whose_stages_both_idled_says_their_compute_did_not_set_the_pace():
    text = format_report(_report(0.401, 0.528, 0.528))
    assert "target    utilization 40.1%  265,527 tok/s (capacity 661,641 tok/s)" in text
    assert "pipeline efficiency 52.8%" in text
    assert f"neither stage was busy {IDLE_BELOW:.0%} of its time" in text.splitlines()[-1]


def test_a_run_with_a_busy_stage_names_no_other_pace():
    for figures in ((0.565, 0.912, 0.912), (0.98, 0.40, 0.60), (0.74, 0.76, 0.74), (0.0, 0.0, 0.0)):
        text = format_report(_report(*figures))
        assert "neither stage" not in text, figures
        assert text.splitlines()[-1].startswith("pipeline efficiency")
