"""Triton model `llm`: streaming generation with continuous batching (kvforge's LLMEngine).

Decoupled: execute() only parses and submits, then returns; the engine's thread generates and
hands its outputs to a sender thread (triton_models/llm_stream.py), so a slow client never
stalls decoding. Inputs and outputs are kvforge/llm_io.py's: the names, dtypes and meanings of
TensorRT-LLM's ensemble / tensorrt_llm_bls models (README "Inputs and outputs" lists each), so
/v2/models/llm/generate, /generate_stream and gRPC stream_infer work as with those; a request
with `stop` true is TensorRT-LLM's signal that ends the live request with the same request id.
Every error goes out behind its kind's prefix (kvforge/errors.py): refusals for load (queue
full, queue timeout) start with "UNAVAILABLE:", server faults with "INTERNAL:".

Prefix caching: an optional `cache_salt` input isolates a tenant's cached prefixes, every
response carries `cached_tokens`, and a request with `clear_prefix_cache` true and the operator's
`control_key` (the server's KVFORGE_CONTROL_KEY) empties the prefix cache without a restart.
The engine's settings come from this model's config.pbtxt parameters (slots, max_waiting,
kv_cache_bytes) and the KVFORGE_* environment the launcher writes (kvforge/engine_config.py).
"""
import json
import os
from pathlib import Path

from kvforge import env
from kvforge.engine_config import EngineConfig
from kvforge.errors import KVForgeError
from kvforge.llm_io import cache_salt, one_value
from kvforge.manifest import cache_namespace
from runtime.llm_engine import LLMEngine
from runtime.sequence import RequestOutput
from triton_models.lifeline import exit_with_server
from triton_models.llm_metrics import EngineMetrics
from triton_models.llm_request import clears_prefix_cache, log_id_of, parse, requested_outputs
from triton_models.llm_stream import ResponseSender, ResponseStream, response
from triton_models.requests import inputs_of, refuse_unknown_parameters
from triton_models.responses import FINAL


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.engine = LLMEngine(Path(args["model_repository"]).parent / params["engine_dir"],
                                EngineConfig.served(params, os.environ))
        # a router trusts this parameter: an engine rebuilt without `engines repository` must not load
        if params.get("cache_namespace") != cache_namespace(self.engine.manifest).hex():
            raise ValueError("config.pbtxt names no cache namespace or another one than the engine's: "
                             "rerun `python -m engines repository` (make build-engines does)")
        access_log = os.environ.get(env.ACCESS_LOG)
        metrics = EngineMetrics({"model": args["model_name"], "version": args["model_version"]},
                                list(self.engine.stats()["tiers"]))
        self.sender = ResponseSender(self.engine, metrics, Path(access_log) if access_log else None)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            log_id = log_id_of(request)
            try:
                inputs = inputs_of(request)
                if clears_prefix_cache(inputs):
                    cleared = self.engine.clear_prefix_cache()
                    sender.send(response(RequestOutput(0, f"cleared {cleared} prefix cache blocks", [], finished=True,
                                                       finish_reason="stop")), flags=FINAL)
                elif one_value(inputs, "stop", False, bool):
                    self.stop(request)
                else:
                    self.submit(request, inputs, sender, log_id)
            except KVForgeError as e:
                self.sender.refuse(sender, log_id, e)
        return None

    def submit(self, request, inputs, sender, log_id):
        prompt, params, stream, echo = parse(request, inputs, self.engine)
        # a `stop` names the request by its Triton id (gRPC) or, over HTTP, by its X-Request-ID
        responses = ResponseStream(sender, stream, log_id, requested_outputs(request), echo,
                                   request.request_id() or log_id)
        responses.request_id = self.engine.submit(prompt, params, self.sender.on_output(responses),
                                                  cache_salt=cache_salt(inputs))
        self.sender.track(responses)

    def stop(self, request):
        """TensorRT-LLM's stop signal (llama-index sends one after every request): end the live
        request with this request id; its stream ends with what it has generated so far."""
        # llama-index marks its stop request with a "Streaming" parameter; nothing else may come along
        refuse_unknown_parameters(request, allowed=("Streaming",))
        self.sender.stop(request.request_id() or log_id_of(request))
        request.get_response_sender().send(flags=FINAL)

    def finalize(self):
        self.engine.close()  # ends what is left with an error output, which the sender still sends
        self.sender.close()
