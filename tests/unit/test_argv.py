"""core/argv: a flag's value on a command line, both spellings, and its absence."""

from dynamod.core.argv import flag_value


def test_a_flag_s_value_in_either_spelling_and_none_without_one() -> None:
    command = ["python", "-m", "w", "--engine", "mocker", "--model-name=tiny", "--last"]
    assert flag_value(command, "--engine") == "mocker"
    assert flag_value(command, "--model-name") == "tiny"
    assert flag_value(command, "--last") is None  # at the end, with no value after it
    assert flag_value(command, "--model") is None  # a prefix of another flag is not it
    assert flag_value(["--engine", "a", "--engine", "b"], "--engine") == "a"  # the first
