"""Learning `auto` (`braid.engine.step_choice`): it probes each setting, keeps the fastest per
step bucket, drops a clearly slower one early, and probes again when times drift."""

from __future__ import annotations

from braid.engine import step_choice
from braid.engine.step_choice import StepChooser, describe, step_bucket

OFF = (("overlap", False), ("compression", "none"))
ON = (("overlap", True), ("compression", "none"))
INT8 = (("overlap", True), ("compression", "int8"))


def run_steps(chooser: StepChooser, bucket: str, candidates, seconds_of, steps: int,
              tokens: int = 100) -> list:
    """`steps` steps of `bucket`, each taking `seconds_of[setting]` per token; the settings."""
    ran = []
    for _ in range(steps):
        setting, _ = chooser.choose(bucket, candidates)
        chooser.observe(bucket, setting, seconds_of[setting] * tokens, tokens)
        ran.append(setting)
    return ran


def test_buckets_by_kind_and_power_of_two():
    assert step_bucket(1, True) == "decode:1" and step_bucket(4, True) == "decode:4"
    assert step_bucket(17, True) == step_bucket(64, True) == "decode:64"
    assert step_bucket(4096, False) == "prefill:4096" != step_bucket(4097, False)
    assert step_bucket(1025, False) == "prefill:4096"
    assert describe(INT8) == "overlap=on compression=int8"


def test_probes_each_setting_then_keeps_the_fastest():
    chooser = StepChooser()
    times = {OFF: 1.0, ON: 0.8, INT8: 0.5}
    ran = run_steps(chooser, "prefill:4096", [OFF, ON, INT8], times, 40)
    probes = chooser.probe_steps
    assert set(ran[:3]) == {OFF, ON, INT8}  # each once untimed first
    assert probes <= 3 + 3 * step_choice.PROBES and set(ran[probes:]) == {INT8}
    assert chooser.choices() == {"prefill:4096": "overlap=on compression=int8"}
    # another bucket learns on its own, timing from its first step (the settings ran once)
    probes = chooser.probe_steps
    run_steps(chooser, "decode:16", [OFF, ON, INT8], {OFF: 0.1, ON: 0.3, INT8: 0.2}, 20)
    assert chooser.choices()["decode:16"] == "overlap=off compression=none"
    assert chooser.probe_steps - probes <= 3 * step_choice.PROBES


def test_a_clearly_slower_setting_is_timed_once():
    chooser = StepChooser()
    ran = run_steps(chooser, "prefill:512", [OFF, INT8], {OFF: 3.0, INT8: 1.0}, 12)
    assert ran.count(OFF) == 2  # untimed, then one timed step 3x the best
    assert chooser.choices()["prefill:512"] == "overlap=on compression=int8"


def test_drift_makes_the_bucket_probe_again():
    chooser = StepChooser()
    times = {OFF: 1.0, INT8: 0.5}
    run_steps(chooser, "prefill:4096", [OFF, INT8], times, 20)
    assert chooser.choices()["prefill:4096"] == "overlap=on compression=int8"
    probes = chooser.probe_steps
    times[INT8] = 2.0  # the link got slower: compression's steps drift
    ran = run_steps(chooser, "prefill:4096", [OFF, INT8], times, 30)
    assert chooser.probe_steps > probes and OFF in ran
    assert chooser.choices()["prefill:4096"] == "overlap=off compression=none"


def test_a_single_candidate_is_not_learned():
    chooser = StepChooser()
    assert chooser.choose("decode:1", [OFF]) == (OFF, False)
    chooser.observe("decode:1", OFF, 1.0, 1)
    assert chooser.choices() == {} and chooser.probe_steps == 0


def test_a_new_bucket_skips_what_its_neighbour_found_clearly_slower():
    chooser = StepChooser()
    times = {OFF: 3.0, ON: 2.5, INT8: 1.0}
    run_steps(chooser, "prefill:1024", [OFF, ON, INT8], times, 12)
    assert chooser.choices()["prefill:1024"] == "overlap=on compression=int8"
    ran = run_steps(chooser, "prefill:4096", [OFF, ON, INT8], times, 6)
    assert set(ran) == {INT8}  # the others lost clearly next door: not probed here
    # decode steps are another kind: they learn from scratch
    ran = run_steps(chooser, "decode:16", [OFF, ON, INT8], times, 8)
    assert OFF in ran and ON in ran
