"""Triton model `step`: the raw decoder step for scoring, batched by Triton's dynamic batcher.

input_ids [1, n] (INT64, one sequence per request; other shapes are refused) -> logits
[1, n, vocab] (FP32) of every position, n at most runtime/scorer.py's bound. Requests that
arrive together run as one padded batch, in prompt chunks through a cache no request outlives.
"""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kvforge.errors import RequestError
from runtime.scorer import Scorer
from triton_models.lifeline import exit_with_server
from triton_models.responses import error


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        config = json.loads(args["model_config"])
        engine_dir = Path(args["model_repository"]).parent / config["parameters"]["engine_dir"]["string_value"]
        self.scorer = Scorer(engine_dir, max_rows=config["max_batch_size"])

    def execute(self, requests):
        responses, batch = [None] * len(requests), []
        for i, request in enumerate(requests):
            try:
                batch.append((i, self.scorer.check(pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy())))
            except RequestError as e:
                responses[i] = error(e.kind, str(e))
        if batch:
            for (i, _), logits in zip(batch, self.scorer.score([ids for _, ids in batch])):
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("logits", np.ascontiguousarray(logits[None]))])
        return responses
