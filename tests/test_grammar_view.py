"""The sampling view's account of a grammar: the mask as a stage, where the output stands, the moments.

Pure functions, no page: the stages rebuilt from a token event's masked rows, the JSON path of a
partial text, a request's tag, and the moments lesson mode pauses at (mask_forced, one_token_allowed).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.backend.events.moments import MomentFinder, mask_forced
from kvscope.frontend.grammar_position import json_path, position_text, tagged
from kvscope.frontend.sampling_math import GRAMMAR_STAGES, STAGES, Knobs, Mask, compute_stages
from kvscope.frontend.views.sampling import share

# A model that wants prose ("The" 0.5, "A" 0.3) under a grammar that allows "{" (0.15) and " {" (0.05):
# the mask removes 0.8 of the model's mass; after it, "{" has 0.75 and " {" 0.25.
TOP = [[1, "{", 0.75, 1.0], [2, " {", 0.25, 0.0], [0, "EOS", 0.0, 0.0]]
MASK = Mask(mass=0.8, top=[[3, "The", 0.5], [4, "A", 0.3]], num_allowed=2)


def test_the_model_stage_comes_first_with_the_masked_tokens_among_the_shown_by_the_models_p():
    stages = compute_stages(TOP, Knobs(temperature=0.0), {0}, vocab_size=10, mask=MASK)
    assert stages.names == GRAMMAR_STAGES and stages.names[1:2] == ("masked",)
    assert [t for t in stages.token_ids] == [3, 4, 1, 2, 0]  # by the model's own probability
    assert stages.masked == {3, 4, 0}  # EOS has no probability left after the mask either
    assert np.allclose(stages.probs["model"], [0.5, 0.3, 0.15, 0.05, 0.0])
    assert np.allclose(stages.probs["masked"], [0.0, 0.0, 0.75, 0.25, 0.0])
    assert stages.tail["model"] == pytest.approx(0.0) and stages.removed["masked"] == 0.8
    assert stages.probs["min_p"] == [0.0, 0.0, 1.0, 0.0, 0.0]  # greedy picks the model's best allowed


def test_the_later_stages_work_on_what_the_mask_left_exactly_as_without_a_grammar():
    knobs = Knobs(temperature=0.5, top_k=1)
    masked = compute_stages(TOP, knobs, {0}, vocab_size=10, mask=MASK)
    plain = compute_stages(TOP, knobs, {0}, vocab_size=10)
    assert plain.names == STAGES and not plain.masked
    for stage in STAGES[1:]:
        by_token = dict(zip(plain.token_ids, plain.probs[stage], strict=True))
        assert np.allclose([by_token.get(t, 0.0) for t in masked.token_ids], masked.probs[stage])


def test_exact_stages_under_a_mask_read_the_whole_row_after_it():
    row = np.array([0.0, 0.75, 0.25, 0.0, 0.0] + [0.0] * 5)  # the engine keeps the row after the mask
    stages = compute_stages(TOP, Knobs(), {0}, vocab_size=10, row=row, mask=MASK)
    assert stages.exact and stages.tail["masked"] == 0.0 and stages.tail_count == 5
    assert np.allclose(stages.probs["model"], [0.5, 0.3, 0.15, 0.05, 0.0])


@pytest.mark.parametrize("text, path", [
    ("", "$"), ('{"name": "Ada Lov', "$.name"), ('{"name": "Ada", ', "$"), ('{"a": {"b": [1, 2', "$.a.b[1]"),
    ('{"a": [', "$.a[0]"), ('{"a": 1}', "$"), ('{"two words": 1', '$["two words"]'),
    ('{"x": "a \\" , b', "$.x"),  # an escaped quote and a comma inside a string change nothing
    ('[{"k": [[', "$[0].k[0][0]"),
])
def test_the_json_path_is_the_value_being_written(text: str, path: str) -> None:
    assert json_path(text) == path


def test_the_position_line_names_the_grammar_and_where_the_output_stands():
    def sampling(**spec):
        return {"structured_outputs": {"json": None, "json_object": False, "regex": None, "choice": None, "grammar": None,
                                       **spec}}

    assert position_text(sampling(json={"type": "object"}), '{"age": 4') == "grammar: JSON schema · writing $.age"
    assert position_text(sampling(choice=["yes", "no", "yellow"]), "ye") == \
        "grammar: choice of 3 · still open: 'yes', 'yellow'"
    assert position_text(sampling(regex="[0-9]+"), "12") == "grammar: regex '[0-9]+' · matched so far: '12'"
    assert position_text({"temperature": 1.0}, "x") == ""
    assert tagged("person", sampling(json_object=True)) == "person · {json}" and tagged("r", {}) == "r"


def test_a_share_near_all_of_the_mass_is_not_rounded_to_all_of_it():
    assert [share(x) for x in (0.5, 0.994, 0.999, 0.99999, 1.0)] == ["50%", "99%", "99.9%", "99.9%", "100%"]


def token(num_allowed: int, masked_mass: float, top: list, masked: list, step: int = 0) -> dict:
    return {"type": "token", "step": step, "request_id": "r", "num_allowed": num_allowed, "masked_mass": masked_mass,
            "dist": {"top": top, "masked": masked}}


def test_a_mask_forces_a_token_when_it_removed_the_models_best():
    assert mask_forced(token(2, 0.8, TOP, MASK.top))
    # the model's best allowed token (0.75 x 0.8 left = 0.6 of its mass) beats every masked one (0.3)
    assert not mask_forced(token(2, 0.4, [[1, "{", 1.0, 1.0]], [[3, "The", 0.3]]))


def test_lesson_moments_find_the_first_forced_token_and_the_first_single_allowed_one():
    finder = MomentFinder()
    events = [token(2, 0.4, [[1, "{", 1.0, 1.0]], [[3, "The", 0.3]], step=0),
              {"type": "metrics", "step": 0},
              token(1, 0.9, [[1, '"', 1.0, 1.0]], [[3, "x", 0.2]], step=1),
              {"type": "metrics", "step": 1}]
    found = {m.kind: m.step for e in events for m in finder.feed(e)}
    assert found["mask_forced"] == 1  # step 0 kept the model's best; step 1 masked it
    assert found["one_token_allowed"] == 1 and "first_token" in found
