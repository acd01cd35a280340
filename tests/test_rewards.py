import pytest

from grpo.rewards import is_well_formatted, numbers_match, parse_number, reference_answer


@pytest.mark.parametrize("text, value", [
    ("8", 8.0),
    ("$1,200", 1200.0),
    ("The answer is 1,234,567.", 1234567.0),
    ("-3", -3.0),
    ("\u22125 degrees", -5.0),
    ("0.5", 0.5),
    (".75", 0.75),
    ("72.", 72.0),
    ("costs $ 18.00 in total", 18.0),
    ("first 3 then 4 so 7", 7.0),
    ("no number here", None),
    ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("predicted, reference, match", [
    ("18", "18", True),
    ("$18.00", "18", True),
    ("18.", "18", True),
    ("1,080", "1080", True),
    ("-7", "-7", True),
    ("7", "-7", False),
    ("0.25", ".25", True),
    ("19", "18", False),
    ("eighteen", "18", False),
    ("The total is 42 apples.", "42", True),
])
def test_numbers_match(predicted, reference, match):
    assert numbers_match(predicted, reference) is match


def test_reference_answer_takes_text_after_hashes():
    assert reference_answer("3 + 5 = 8\n#### 8") == "8"
    assert reference_answer("He pays $1,200 #### 1,200") == "1,200"
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final line")


@pytest.mark.parametrize("response, ok", [
    ("<think>3 + 5 = 8</think><answer>8</answer>", True),
    ("<think>x</think> <answer>8</answer>\n", True),
    ("<answer>8</answer>", False),
    ("<think>3 + 5 = 8</think>The answer is 8.", False),
    ("<answer>8</answer><think>x</think>", False),
    ("<think>x</think><answer>8</answer> and more text", False),
])
def test_format(response, ok):
    assert is_well_formatted(response) is ok
