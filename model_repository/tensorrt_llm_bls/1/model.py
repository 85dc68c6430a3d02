"""Triton models `tensorrt_llm_bls` and `ensemble`: TensorRT-LLM's model names over the `llm` engine.

Clients such as llama-index's NvidiaTriton default to these names. They take the inputs of
`llm` (TensorRT-LLM's own) and forward each request to it (triton_models/forwarding.py), so there is
no second engine. As in TensorRT-LLM, a request that does not stream gets the prompt in front
of its text unless it sets exclude_input_in_output; a streaming one gets only new text.
"""
import json

import triton_python_backend_utils as pb_utils

from kvforge.errors import RequestError
from kvforge.llm_io import one_value
from triton_models.forwarding import Forwarder, llm_input
from triton_models.lifeline import exit_with_server
from triton_models.requests import inputs_of, refuse_unknown_parameters
from triton_models.responses import FINAL, send_error


def send(sender, response, final) -> bool:
    sender.send(pb_utils.InferenceResponse(output_tensors=response.output_tensors()), flags=FINAL if final else 0)
    return final


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.name = json.loads(args["model_config"])["name"]
        self.forwarder = Forwarder(self.name)

    def execute(self, requests):
        for request in requests:
            try:
                given = inputs_of(request)
                if one_value(given, "stop", False, bool):
                    refuse_unknown_parameters(request, allowed=("Streaming",), model=self.name)
                    self.forwarder.stop_client_request(request)
                    continue
                refuse_unknown_parameters(request, model=self.name)
                inputs = request.inputs()
                if "exclude_input_in_output" not in given:
                    echo = not one_value(given, "stream", False, bool)
                    inputs = [*inputs, llm_input("exclude_input_in_output", [[not echo]])]
                self.forwarder.start(request, inputs, send)
            except RequestError as e:
                send_error(request.get_response_sender(), e.kind, str(e))
        return None
