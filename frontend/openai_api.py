"""The OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) over Triton's gRPC.

    app = create_openai_app(FrontConfig(triton_http=..., triton_grpc="127.0.0.1:8001",
                                        model_repository=Path("model_repository")))

Every choice is one streamed request to the `llm` model (`n` choices are n requests, seeds
seed, seed+1, ...), so there is no second engine. Chat messages become a prompt through the
checkpoint's chat template (frontend/chat_template.py), sent as the token ids transformers'
apply_chat_template makes of it; a thinking model's thought is split off the answer as
reasoning_content (frontend/reasoning.py), and the tool calls in the answer are read out of it
(frontend/tool_calls.py), and tool_choice "required" or a named function sends the grammar that
makes the answer calls. Request bodies are validated against
the fields below; a field kvforge does not know or cannot honour gets an OpenAI-shaped 400
naming it (never silently ignored). A client that disconnects cancels its Triton streams.
Extensions beyond OpenAI's fields, with vLLM's meaning: top_k, min_tokens, repetition_penalty,
ignore_eos, min_p, allowed_token_ids, stop_token_ids, cache_salt (reaches the prefix cache's
salt), the guided_* fields and structured_outputs (constrained decoding, as chat's
response_format: `guide_of`), kvforge's speculative ("ngram" / "off"), and skip_special_tokens /
include_stop_str_in_output at the one value kvforge implements (true / false). An error of the
llm model gets its kind's status (kvforge/errors.py); a message without a kind's prefix (what
the model or Triton refuses) is the request's fault: 400.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, AsyncIterator, Callable, Literal

import numpy as np
import tritonclient.grpc.aio as grpcclient
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Json, JsonValue, field_validator
from tritonclient.utils import InferenceServerException

from engines.repository import engine_dir_of
from frontend.chat_template import ChatTemplate, ChatTemplateError
from frontend.config import RETRY_AFTER_SECONDS, FrontConfig
from frontend.json_text import lone_surrogate
from frontend.reasoning import AFTER, Thoughts, split, start_of, teaches_thinking
from frontend.tool_calls import (NAME_PATTERN, ToolCalls, ToolFormat, arguments_schema, format_of, message_of,
                                 strict_schema)
from frontend.tool_calls import grammar as tool_grammar
from kvforge import llm_io
from kvforge.errors import RequestError, kind_of, quote
from kvforge.llm_io import Delta
from kvforge.manifest import Manifest
from runtime.grammar import CACHE_SIZE, VLLM_KINDS, Guide
from runtime.sampling import MAX_BIAS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, check_in_vocabulary
from runtime.tokenizer import Tokenizer

MAX_CHOICES = 8  # n per request: each choice occupies an engine slot
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions' logprobs (chat's top_logprobs: 20)
MAX_PROMPTS = 8  # prompts in one /v1/completions request
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_TOOLS = 128  # OpenAI's own limit on tools per request
MAX_DOCUMENTS = 64
MAX_TEMPLATE_KWARGS = 32
TOOL_CHOICES = ("none", "auto", "required")
# the template's own variables (frontend/chat_template.py passes them): a kwarg may not replace them
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, retry: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.retry = retry  # the server is busy: the response says when to retry (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.retry else {}


# ---------------------------------------------------------------------- request bodies

class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is an error naming it


class StreamOptions(Body):
    include_usage: bool = False


class StructuredOutputs(Body):
    """vLLM's structured_outputs: one of these constrains the output."""
    json_: str | dict[str, JsonValue] | None = Field(None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF: llguidance's Lark or GBNF
    json_object: bool | None = None


class Sampling(Body):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs; it does not change the answer
    # extensions, as in vLLM
    top_k: int | None = Field(None, ge=0)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False  # end tokens do not end the text; stop strings still do
    cache_salt: str | None = None
    speculative: Literal["ngram", "off"] | None = None  # kvforge's: prompt-lookup speculation (docs/serving.md)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = \
        Field(None, max_length=MAX_LOGIT_BIAS)  # token id (as a string) -> bias added to its logit
    min_p: float | None = Field(None, ge=0, le=1)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True  # true only: kvforge's text never holds special tokens
    include_stop_str_in_output: bool = False  # false only: the text ends before the stop string
    # constrained decoding under vLLM's names (at most one guide per request: guide_of)
    guided_json: str | dict[str, JsonValue] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def token_id_keys(cls, value):
        bad = next((key for key in value or {} if not key.isascii() or not key.isdigit()), None)
        if bad is not None:
            raise ValueError(f"keys are token ids, got {quote(bad)}")
        return value

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids each field names (checked against the vocabulary)."""
        return {"logit_bias": [int(key) for key in self.logit_bias or {}],
                "allowed_token_ids": self.allowed_token_ids or [], "stop_token_ids": self.stop_token_ids or []}


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # the most likely tokens' too
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class Function(Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, JsonValue] | None = None  # a JSON Schema object, passed to the template as sent
    strict: bool | None = None  # a call's arguments follow the schema as OpenAI's strict mode reads it


class Tool(Body):
    type: Literal["function"]
    function: Function


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Body):
    name: str
    # JSON text as OpenAI sends it, parsed: templates take an object, as transformers documents
    # (Llama 3.1's and Command R7B's write it with tojson, which would quote the text once more)
    arguments: Json[JsonValue]


class ToolCall(Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's earlier reasoning, under vLLM's two names (Qwen3's template writes it back
    # into the last turn's <think> block)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_dict(self) -> dict:
        """The message as apply_chat_template takes it: text content, other fields only when sent,
        reasoning under both names templates read (transformers 5 aliases them the same way)."""
        text = "".join(part.text for part in self.content) if isinstance(self.content, list) else (self.content or "")
        message = {"role": self.role, "content": text, **self.model_dump(
            include={"name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"}, exclude_none=True)}
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class JsonSchemaFormat(Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, JsonValue] = Field(alias="schema")
    strict: bool | None = None  # true: read as OpenAI's strict mode (objects take no unlisted properties)


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    # tools reach the chat template as apply_chat_template passes them; the calls in the answer
    # are read out of it (frontend/tool_calls.py)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    documents: list[dict[str, JsonValue]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template_kwargs: dict[str, JsonValue] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)

    @field_validator("tool_choice")
    @classmethod
    def known_tool_choice(cls, value):
        # a str beside the object in the union: an unknown word's error names tool_choice alone
        if isinstance(value, str) and value not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}}, got {quote(value)}")
        return value


# ---------------------------------------------------------------------- one choice = one llm stream

@dataclass
class Choice:
    index: int
    prompt_index: int
    inputs: list
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.top_logprobs += delta.top_logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_tokens, self.cached_tokens = delta.prompt_tokens, delta.cached_tokens


def tensor(name: str, value):
    """An llm input (kvforge/llm_io.py's datatype) holding one value or one list of values."""
    spec = llm_io.INPUTS[name]
    if spec.datatype == "BYTES":
        value = [v.encode("utf-8") for v in (value if isinstance(value, list) else [value])]
    data = np.array([value if isinstance(value, list) else [value]], dtype=spec.numpy_dtype)
    infer_input = grpcclient.InferInput(name, list(data.shape), spec.datatype)
    infer_input.set_data_from_numpy(data)
    return infer_input


def guide_of(body: Sampling, tool_format: ToolFormat | None = None, thinks: bool = False) -> Guide | None:
    """The guide for llm's guided_decoding inputs of whichever field constrains the output: chat's
    tool_choice (required or a named function: the calls' grammar in the model's tool_format) or
    response_format, vLLM's guided_* or structured_outputs; a 400 naming the field when two do,
    when a response_format is malformed, when the guide does not compile, or when the answer may
    begin with a thought (thinks: the guide would hold from its first token, where the model
    writes <think>)."""
    given = []  # (field, guide kind, its text or JSON value)
    tools = tool_guide(body, tool_format) if isinstance(body, ChatRequest) and tool_format is not None else None
    if tools is not None:
        given.append(("tool_choice", "ebnf_grammar", tools))
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        if (response_format.type == "json_schema") != (response_format.json_schema is not None):
            raise APIError(400, "response_format.json_schema goes with type json_schema, and only with it",
                           param="response_format.json_schema")
        if response_format.type == "json_schema":
            schema = response_format.json_schema.schema_
            given.append(("response_format", "json_schema",
                          json.dumps(strict_schema(schema) if response_format.json_schema.strict else schema)))
        elif response_format.type == "json_object":
            given.append(("response_format", "json", ""))
    outputs = (body.structured_outputs or StructuredOutputs()).model_dump(by_alias=True)
    for prefix, values in (("guided_", {key: getattr(body, f"guided_{key}", None) for key in VLLM_KINDS}),
                           ("structured_outputs.", outputs)):
        given += [(prefix + key, kind, values[key]) for key, kind in VLLM_KINDS.items()
                  if values[key] not in (None, False)]  # json_object false asks for nothing
    if len(given) > 1:
        raise APIError(400, f"{given[0][0]} and {given[1][0]} both constrain the output; send one of them",
                       param=given[1][0])
    if not given:
        return None
    name, kind, value = given[0]
    if thinks:
        raise APIError(400, f"{name} constrains the whole answer, but this model thinks first (<think>...</think>, "
                            "which the constraint would forbid); send chat_template_kwargs {\"enable_thinking\": "
                            "false} where the template takes it, or serve with --reasoning-parser off", param=name)
    guide = Guide.of_value(kind, value)
    problem = guide_error(guide)
    if problem:
        raise APIError(400, problem, param="response_format.json_schema.schema" if kind == "json_schema" and
                       name == "response_format" else name)
    return guide


@functools.lru_cache(maxsize=CACHE_SIZE)
def guide_error(guide: Guide) -> str | None:
    return guide.error()


def tool_guide(body: ChatRequest, tool_format: ToolFormat) -> str | None:
    """The grammar that makes the answer tool calls and nothing else, for tool_choice "required"
    (any offered tool; one call, or one or more with parallel_tool_calls) or a named function; a
    400 naming the tool whose parameters do not compile."""
    choice = body.tool_choice
    if not isinstance(choice, NamedToolChoice) and choice != "required":
        return None
    functions = [(i, tool.function) for i, tool in enumerate(body.tools or [])
                 if not isinstance(choice, NamedToolChoice) or tool.function.name == choice.function.name]
    if not functions:
        wanted = "tools" if choice == "required" else f"a tool named {quote(choice.function.name)} in tools"
        raise APIError(400, f"this tool_choice needs {wanted}", param="tool_choice")
    schemas = []
    for i, function in functions:
        schema = arguments_schema(function.parameters, bool(function.strict))
        problem = guide_error(Guide("json_schema", json.dumps(schema)))
        if problem:
            raise APIError(400, f"the parameters of tool {quote(function.name)} do not compile: {problem}",
                           param=f"tools.{i}.function.parameters")
        schemas.append((function.name, schema))
    return tool_grammar(tool_format, schemas, body.parallel_tool_calls)


def llm_inputs(prompt: str | list[int], body: Sampling, guide: Guide | None, max_tokens: int, seed: int | None,
               echo: bool, logprobs: int | None) -> list:
    """llm's inputs for one choice; logprobs: None, or how many most likely tokens' log-probs
    come with the chosen one's."""
    inputs = [tensor("input_ids", prompt) if isinstance(prompt, list) else tensor("text_input", prompt),
              tensor("max_tokens", max_tokens), tensor("stream", True),
              tensor("temperature", body.temperature), tensor("top_p", body.top_p)]
    optional = [("seed", seed), ("top_k", body.top_k), ("min_tokens", body.min_tokens),
                ("repetition_penalty", body.repetition_penalty), ("cache_salt", body.cache_salt),
                ("speculative", body.speculative),
                ("presence_penalty", body.presence_penalty or None),
                ("frequency_penalty", body.frequency_penalty or None),
                ("stop_words", [body.stop] if isinstance(body.stop, str) else (body.stop or None)),
                ("ignore_eos", True if body.ignore_eos else None),
                ("exclude_input_in_output", False if echo else None),
                ("return_log_probs", True if logprobs is not None else None), ("logprobs", logprobs or None),
                ("min_p", body.min_p), ("allowed_token_ids", body.allowed_token_ids or None),
                ("stop_token_ids", body.stop_token_ids or None)]
    if body.logit_bias:
        optional += [("logit_bias_token_ids", [int(key) for key in body.logit_bias]),
                     ("logit_bias", list(body.logit_bias.values()))]
    if guide is not None:
        optional += [("guided_decoding_guide_type", guide.kind), ("guided_decoding_guide", guide.text or None)]
    return inputs + [tensor(name, value) for name, value in optional if value is not None]


def triton_error(error: InferenceServerException) -> APIError:
    """An llm stream's error (over gRPC its message alone, no status) with its kind's status."""
    message = error.message()
    kind = kind_of(message)
    return APIError(kind.http_status, message, kind=kind.openai_type, retry=kind.retry)


# ---------------------------------------------------------------------- the app

class OpenAIServer:
    def __init__(self, config: FrontConfig):
        self.config = config
        engine_dir = engine_dir_of(Path(config.model_repository), config.model)
        self.manifest = Manifest.load(engine_dir)
        self.tokenizer = Tokenizer(engine_dir, self.manifest)
        self.chat_template = ChatTemplate(engine_dir)
        self.tool_format = format_of(self.chat_template.source)
        self.reasoning = config.reasoning_parser and teaches_thinking(self.chat_template.source)
        self._client: grpcclient.InferenceServerClient | None = None

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:  # made inside the event loop that uses it
            self._client = grpcclient.InferenceServerClient(self.config.triton_grpc)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def stream(self, inputs: list, request_id: str) -> AsyncIterator[Delta]:
        """One llm request's deltas; leaving early (or being cancelled) cancels it in Triton."""
        async def requests():
            yield {"model_name": self.config.model, "inputs": inputs, "request_id": request_id}

        responses = self.client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    raise triton_error(error)
                delta = Delta.from_result(result)
                yield delta
                if delta.finish_reason:
                    return
        finally:
            responses.cancel()

    def tool_reader(self, body: ChatRequest) -> Callable[[], ToolCalls] | None:
        """What reads each choice's answer as content and tool calls (None: the answer is content:
        no tools, or tool_choice "none")."""
        if not body.tools or body.tool_choice == "none":
            return None
        enforced = body.tool_choice not in (None, "auto")
        names = {tool.function.name for tool in body.tools}
        return functools.partial(ToolCalls, self.tool_format, names, enforced)

    def check_model(self, body: Sampling) -> None:
        if body.model != self.config.model:
            raise APIError(404, f"the model {quote(body.model)} does not exist; this server serves {self.config.model!r}",
                           param="model", code="model_not_found")

    def check_token_ids(self, body: Sampling) -> None:
        """A 400 naming the field whose token id is not in the model's vocabulary."""
        for name, ids in body.token_ids().items():
            try:
                check_in_vocabulary(name, ids, self.manifest.model.vocab_size)
            except RequestError as e:
                raise APIError(400, str(e), param=name) from None

    def max_tokens(self, prompt: str | list[int], requested: int | None) -> int:
        """What the client asked for, or (no limit given) the rest of the context."""
        if requested is not None:
            return requested
        length = len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))
        return max(1, self.manifest.max_seq_len - length)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        return self.chat_ids(render_chat(self.chat_template, body))

    def chat_ids(self, rendered: str) -> list[int]:
        """The token ids of a rendered chat, as apply_chat_template(tokenize=True) makes them: the
        template writes every special token it wants (Llama 3's and Gemma's their BOS, ChatML's
        none) and the tokenizer adds none, so a BOS post-processor neither doubles the template's
        nor puts one before a template that has none."""
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def thinking(self, rendered: str) -> str | None:
        """Where the answer to a rendered chat begins, inside, after or before a thought
        (frontend/reasoning.py); None: the answer is content (no reasoning parser)."""
        return start_of(rendered) if self.reasoning else None


def render_chat(template: ChatTemplate, body: ChatRequest) -> str:
    """A chat body's prompt: its messages, tools, documents and chat_template_kwargs passed to the
    template as apply_chat_template passes them."""
    refuse_unsupported_chat(body)
    # tool_choice "none": the template gets no tools, so the prompt offers the model none to call
    tools = None if body.tools is None or body.tool_choice == "none" \
        else [tool.model_dump(exclude_none=True) for tool in body.tools]
    try:
        return template.render([m.template_dict() for m in body.messages], tools=tools, documents=body.documents,
                               **(body.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def refuse_unsupported(body: Sampling) -> None:
    """Fields whose only value kvforge can honour is their default, and one that needs another."""
    if not body.skip_special_tokens:
        raise APIError(400, "skip_special_tokens must be true: kvforge's text never holds special tokens",
                       param="skip_special_tokens")
    if body.include_stop_str_in_output:
        raise APIError(400, "include_stop_str_in_output must be false: kvforge's text ends before the stop string",
                       param="include_stop_str_in_output")
    if isinstance(body, ChatRequest) and body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n: kvforge returns every sequence it generates", param="best_of")


def refuse_unsupported_chat(body: ChatRequest) -> None:
    """chat_template_kwargs may not replace the template's own variables."""
    colliding = sorted(TEMPLATE_VARIABLES & set(body.chat_template_kwargs or {}))
    if colliding:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(colliding)}: the chat template's own "
                            "variables come from the request", param="chat_template_kwargs")


def usage(choices: list[Choice]) -> dict:
    first_of_prompt = {c.prompt_index: c for c in reversed(choices)}  # n choices share one prompt
    prompt_tokens = sum(c.prompt_tokens for c in first_of_prompt.values())
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in first_of_prompt.values())}}


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Completion:
    """One /v1 request in flight: its choices' llm streams fanned into one queue."""

    def __init__(self, server: OpenAIServer, kind: str, body: Sampling, choices: list[Choice], logprobs: int | None,
                 tool_reader: Callable[[], ToolCalls] | None = None, thinking: str | None = None):
        self.server, self.kind, self.body, self.choices = server, kind, body, choices
        self.logprobs = logprobs  # None: no log-probs; else how many most likely tokens come with each chosen one
        self.tool_reader = tool_reader  # chat with tools: each choice's answer is read for calls
        self.streamed_calls: dict[int, ToolCalls] = {}  # a streaming choice's reader
        self.thinking = thinking  # chat of a thinking model: where each answer begins (frontend/reasoning.py)
        self.streamed_thoughts: dict[int, Thoughts] = {}
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(choice)) for choice in self.choices]

    async def _run(self, choice: Choice) -> None:
        try:
            async for delta in self.server.stream(choice.inputs, f"{self.id}-{choice.index}"):
                choice.add(delta)
                await self.queue.put((choice, delta))
        except APIError as e:
            await self.queue.put((choice, e))
        finally:
            await self.queue.put((choice, None))

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def events(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """Each choice's deltas as they come; raises the first error."""
        open_choices = len(self.choices)
        while open_choices:
            choice, item = await self.queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield choice, item

    async def gather(self, request: Request) -> None:
        """Wait for every choice to finish; a client that goes away cancels them."""
        async def drain():
            async for _ in self.events():
                pass

        work, watcher = asyncio.create_task(drain()), asyncio.create_task(until_disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise APIError(499, "the client disconnected")
            work.result()
        finally:
            watcher.cancel()
            work.cancel()
            self.cancel()

    # ------------------------------------------------------------------ response bodies

    def logprobs_of(self, token_ids: list[int], logprobs: list[float],
                    tops: list[list[tuple[int, float]]]) -> dict | None:
        if self.logprobs is None:
            return None
        text = self.server.tokenizer.decode
        tokens = [text([t]) for t in token_ids]
        tops = tops or [[] for _ in token_ids]  # none asked for
        if self.kind == "chat":
            def entry(token: str, logprob: float) -> dict:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**entry(t, lp), "top_logprobs": [entry(text([i]), v) for i, v in top]}
                                for t, lp, top in zip(tokens, logprobs, tops)], "refusal": None}
        offsets = np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist() if tokens else []
        # as OpenAI: each position's most likely tokens and the chosen one (up to logprobs + 1)
        top_dicts = [{**{text([i]): v for i, v in top}, t: lp} for t, lp, top in zip(tokens, logprobs, tops)] \
            if self.logprobs else None
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}.get(
            (self.kind, chunk), "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.body.model,
                "system_fingerprint": None, "choices": choices}

    def choice_body(self, choice: Choice, text: str, token_ids: list[int], logprobs: list[float],
                    tops: list[list[tuple[int, float]]], finish_reason: str | None, chunk: bool) -> dict:
        body = {"index": choice.index, "logprobs": self.logprobs_of(token_ids, logprobs, tops),
                "finish_reason": finish_reason}
        if self.kind != "chat":
            body["text"] = text
            return body
        thought = None  # the thought's text (streamed: its new text), before the content
        if self.thinking is not None:
            if chunk:
                thoughts = self.streamed_thoughts.setdefault(choice.index, Thoughts(self.thinking))
                thought, text = thoughts.feed(text, finished=finish_reason is not None)
                thought = thought or None
            else:
                thought, text = split(self.thinking, text)
        message = {"role": "assistant", "content": text}
        if self.tool_reader is not None:  # the calls are read out of the content, after any thought
            if chunk:
                reader = self.streamed_calls.setdefault(choice.index, self.tool_reader())
                content, calls = reader.feed(text, finished=finish_reason is not None)
                content = content or (None if calls else "")
            else:
                reader = self.tool_reader()
                content, calls = message_of(reader, text)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            if reader.called and finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        if thought is not None:  # as vLLM: no answer after the thought is a null content
            message = {**message, "content": message["content"] or None, "reasoning_content": thought}
        body["delta" if chunk else "message"] = message
        return body

    def final(self) -> dict:
        body = self.envelope([self.choice_body(c, c.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason,
                                               chunk=False)
                              for c in self.choices], chunk=False)
        return {**body, "usage": usage(self.choices)}

    async def sse(self, first: tuple[Choice, Delta], rest: AsyncIterator[tuple[Choice, Delta]]) -> AsyncIterator[str]:
        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def all_events():
            yield first
            async for item in rest:
                yield item

        try:
            async for choice, delta in all_events():
                yield event(self.envelope([self.choice_body(choice, delta.text, delta.token_ids, delta.logprobs or [],
                                                            delta.top_logprobs or [], delta.finish_reason, chunk=True)],
                                          chunk=True))
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield event({**self.envelope([], chunk=True), "usage": usage(self.choices)})
        except APIError as e:  # after the 200 went out, an error is one more event
            yield event(e.body())
        finally:
            self.cancel()
        yield "data: [DONE]\n\n"

    async def respond(self, request: Request):
        self.start()
        if not self.body.stream:
            await self.gather(request)
            return JSONResponse(self.final())
        events = self.events()
        try:  # the first delta decides between a 200 stream and an error status
            first = await events.__anext__()
        except BaseException:
            self.cancel()
            raise
        return StreamingResponse(self.sse(first, events), media_type="text/event-stream")


def create_openai_app(config: FrontConfig) -> FastAPI:
    server = OpenAIServer(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await server.close()

    app = FastAPI(title="kvforge OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        problem = error.errors()[0]
        param = ".".join(str(p) for p in problem["loc"][1:]) or None
        if problem["type"] == "extra_forbidden":
            message = f"unknown field {param}: kvforge does not read it (see README, OpenAI-compatible API)"
        else:
            message = f"{param}: {problem['msg']}" if param else problem["msg"]
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    async def authorize(request: Request) -> None:
        if config.api_key and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    async def unicode_body(request: Request) -> None:
        """A body with a lone surrogate escape is the client's error, not a 500 when it is encoded."""
        try:
            body = await request.json()  # parsed once: FastAPI has read it already, and this is its cache
        except ValueError:
            return  # not JSON at all: the body's validation says so
        not_text = lone_surrogate(body)
        if not_text:
            param, message = not_text
            raise APIError(400, message, param=param)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": config.model, "object": "model", "created": 0, "owned_by": "kvforge"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize), Depends(unicode_body)])
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body)
        refuse_unsupported(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
            else body.prompt
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"send 1..{MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
        server.check_token_ids(body)

        def choices() -> list[Choice]:
            guide = guide_of(body)
            return [Choice(p * body.n + j, p, llm_inputs(prompt, body, guide,
                                                         server.max_tokens(prompt, body.max_tokens),
                                                         seed_of(body, j), body.echo, body.logprobs))
                    for p, prompt in enumerate(prompts) for j in range(body.n)]

        # tokenizing a long prompt is off the event loop, which relays every other stream's tokens
        return await Completion(server, "text", body, await asyncio.to_thread(choices), body.logprobs).respond(request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize), Depends(unicode_body)])
    async def chat_completions(body: ChatRequest, request: Request):
        server.check_model(body)
        refuse_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; send one", param="max_completion_tokens")
        server.check_token_ids(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None

        def choices() -> tuple[list[Choice], str | None]:
            rendered = render_chat(server.chat_template, body)
            thinking = server.thinking(rendered)
            guide = guide_of(body, server.tool_format, thinks=thinking not in (None, AFTER))
            prompt = server.chat_ids(rendered)
            max_tokens = server.max_tokens(prompt, body.max_completion_tokens or body.max_tokens)
            return [Choice(j, 0, llm_inputs(prompt, body, guide, max_tokens, seed_of(body, j), False, logprobs))
                    for j in range(body.n)], thinking

        # rendering the template, checking a guide and tokenizing are off the event loop, which relays every
        # other stream's tokens
        made, thinking = await asyncio.to_thread(choices)
        return await Completion(server, "chat", body, made, logprobs, server.tool_reader(body),
                                thinking).respond(request)

    return app


def seed_of(body: Sampling, choice: int) -> int | None:
    """Choice j of a seeded request uses seed + j: reproducible, and the n choices differ."""
    return None if body.seed is None else (body.seed + choice) % 2**64
