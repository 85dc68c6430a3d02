"""Alias models forward each request to `llm` over BLS, so one engine serves every model name.

A forwarded request runs on its own thread (BLS `exec` blocks while streaming). Cancellation
uses the TensorRT-LLM stop signal: when the alias's client goes away, or a client sends `stop`
naming the alias request's id, the alias sends `llm` a `stop` request naming the id it gave
the forwarded request. Imported only inside Triton python-backend models.
"""
from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from kvforge import llm_io
from kvforge.errors import CANCELLED, INTERNAL, kind_of
from triton_models.responses import CANCELLED_MESSAGE, FINAL, send_error

TARGET = "llm"
CANCEL_POLL_SECONDS = 0.1  # is_cancelled() is a round trip to the server: not once per token


def llm_input(name: str, value) -> pb_utils.Tensor:
    """An input for llm (`value` nested batch first, e.g. [[True]]) in the dtype kvforge/llm_io.py gives it."""
    return pb_utils.Tensor(name, np.array(value, dtype=llm_io.INPUTS[name].numpy_dtype))


def tensor_value(response, name):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


def finish_reason(response) -> str:
    """llm's last response is the one with a finish reason."""
    value = tensor_value(response, "finish_reason")
    return value.reshape(-1)[0].decode() if value is not None and value.size else ""


class Forwarder:
    """The forwards one alias model has in flight, by the alias request's id."""

    def __init__(self, alias: str):
        self.alias = alias
        self.lock = threading.Lock()
        self.by_client_id: dict[str, str] = {}  # alias request id -> forwarded request id

    def start(self, request, inputs, on_response) -> None:
        """Forward `inputs` to llm on a thread; on_response(llm_response, final) translates and
        sends each one (returns False to stop early, e.g. after sending an error)."""
        forward_id = f"{self.alias}-{uuid.uuid4().hex}"
        client_id = request.request_id()
        sender = request.get_response_sender()
        if client_id:
            with self.lock:
                self.by_client_id[client_id] = forward_id
        threading.Thread(target=self._run, args=(client_id, forward_id, sender, inputs, on_response),
                         name=f"{self.alias}-forward", daemon=True).start()

    def _run(self, client_id, forward_id, sender, inputs, on_response) -> None:
        final_sent, next_poll = False, 0.0
        try:
            forward = pb_utils.InferenceRequest(model_name=TARGET, inputs=inputs, request_id=forward_id,
                                                requested_output_names=list(llm_io.OUTPUTS))
            for response in forward.exec(decoupled=True):
                if final_sent:
                    continue  # drain what llm still sends after a cancel
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + CANCEL_POLL_SECONDS
                    if sender.is_cancelled():
                        self.stop(forward_id)
                        send_error(sender, CANCELLED, CANCELLED_MESSAGE)
                        final_sent = True
                        continue
                if response.has_error():  # llm's message carries its kind: passed on with the kind's code
                    message = response.error().message()
                    send_error(sender, kind_of(message), message)
                    final_sent = True
                elif response.output_tensors():
                    final_sent = on_response(sender, response, bool(finish_reason(response)))
        except Exception as e:  # the forward itself failed: the client must still get an answer
            if not final_sent:
                send_error(sender, INTERNAL, f"{self.alias}: forwarding to {TARGET} failed: {e}")
                final_sent = True
        finally:
            if not final_sent:
                sender.send(flags=FINAL)
            if client_id:
                with self.lock:
                    if self.by_client_id.get(client_id) == forward_id:
                        del self.by_client_id[client_id]

    def stop_client_request(self, request) -> None:
        """TensorRT-LLM's stop signal sent to the alias: stop what it forwarded for that id."""
        with self.lock:
            forward_id = self.by_client_id.get(request.request_id()) if request.request_id() else None
        if forward_id is not None:
            self.stop(forward_id)
        request.get_response_sender().send(flags=FINAL)

    @staticmethod
    def stop(forward_id: str) -> None:
        signal = llm_input("stop", [[True]])
        for _ in pb_utils.InferenceRequest(model_name=TARGET, inputs=[signal], request_id=forward_id,
                                           requested_output_names=[]).exec(decoupled=True):
            pass
