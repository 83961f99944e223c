"""Answer extraction and voting (the tools that score kept threads are tested in research/tests/)."""

from policies.extraction import answers_match, extract_chain_answer
from policies.voting import majority_vote


def test_extraction_takes_the_number_after_the_last_marker():
    assert extract_chain_answer("c=49\n#49") == "49"
    assert extract_chain_answer("#12 then #07") == "7"
    assert extract_chain_answer("#00") == "0"
    assert extract_chain_answer("no marker 42") is None
    assert extract_chain_answer("ends with #") is None


def test_answers_compare_as_numbers():
    assert answers_match("7", "07") and answers_match("0", "0")
    assert not answers_match(None, "0") and not answers_match("70", "7")


def test_majority_vote_counts_and_breaks_ties_by_confidence_not_arrival():
    vote = majority_vote(["3", None, "5", "5", "3", "9"])
    assert vote.answer == "3" and vote.counts == {"3": 2, "5": 2, "9": 1}  # no confidences: the first to appear
    assert majority_vote(["5", "3", "3"]).answer == "3"
    assert majority_vote([None, None]).answer is None
    # With confidences a tie goes to the more confident answer, whatever order the threads arrived in.
    answers, confidences = ["3", None, "5", "5", "3", "9"], [-0.4, -0.1, -0.1, -0.2, -0.3, -0.01]
    assert majority_vote(answers, confidences).answer == "5"
    order = [5, 3, 0, 2, 4, 1]
    assert majority_vote([answers[i] for i in order], [confidences[i] for i in order]).answer == "5"
    assert majority_vote(["3", "5", "5"], [-0.1, -0.9, -0.9]).answer == "5"  # a count is never outvoted by confidence
