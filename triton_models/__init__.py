"""Code only Triton python-backend stubs import (as vllm_backend keeps src/utils/). Triton loads
every folder inside model_repository/ as a model, so shared stub code lives here:

    requests.py     a request's inputs for kvforge/llm_io.py's readers; unknown request parameters refused
    responses.py    the final flag; errors behind their kind's prefix with its Triton code
    lifeline.py     every stub exits once the tritonserver that started it is gone
    llm_request.py  the llm model's request: SamplingParams, the prefix-cache clear, its log id
    llm_stream.py   the llm model's responses: one ResponseStream per request, the sender thread
    llm_metrics.py  the llm model's custom metrics and latency histograms
    forwarding.py   the aliases forward each request to llm over BLS
"""
