"""Each engine's base model, read from the `model_name` label of its metrics."""

from __future__ import annotations

from extproc.engines.base_models import BaseModels
from extproc.engines.scraper import parse_families

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base-model"} 3.0
"""


def test_the_model_name_label_is_the_engines_base_model() -> None:
    learnt: list[tuple[str, str]] = []
    consumer = BaseModels(lambda address, model: learnt.append((address, model)))
    consumer.consume("10.0.0.1:8000", parse_families(PAGE, tuple(consumer.families)))
    consumer.consume("10.0.0.2:8000", parse_families("", tuple(consumer.families)))
    unlabelled = PAGE.replace(',model_name="base-model"', "")
    consumer.consume("10.0.0.3:8000", parse_families(unlabelled, tuple(consumer.families)))
    assert learnt == [("10.0.0.1:8000", "base-model")]
