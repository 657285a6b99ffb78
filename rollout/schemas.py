"""The server's request schemas as pydantic models: SGLang 0.5.23's ``SamplingParams`` and the
fields of its ``GenerateReqInput`` that this engine honours or refuses.

Every SamplingParams field is a field here: the honoured ones typed and range-checked, the ones
this engine cannot do (constrained decoding, penalties, logit bias, beam search) accepted only
at the value that changes nothing. An unknown sampling field is an error (SGLang's
``SamplingParams(**d)`` fails on one too); unknown top-level request fields are ignored, as
SGLang ignores them. ``ValidationError``s become one line naming the field (``one_line``).

JSON numbers: integers are strict (``2.5`` or ``true`` is not a token count), real-valued
fields take integers or floats, never booleans, and must be finite.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError("expected a finite number")
    return float(v)


Number = Annotated[Union[StrictInt, StrictFloat], AfterValidator(_finite)]


def _only(*neutral, why: str | None = None):
    """A field that cannot be honoured: accepted only at a value that changes nothing (of the
    same type: ``0`` is not ``False``)."""
    def check(v):
        if not any(v == n and type(v) is type(n) for n in neutral):
            raise ValueError(f"not supported by this server ({why})" if why else f"not supported by this engine (only {neutral[0]!r})")
        return v
    return AfterValidator(check)


def _top_k(v: int) -> int:
    if v < -1:
        raise ValueError("expected -1 (off) or an integer >= 0")
    return v


def _stop(v):
    stops = [v] if isinstance(v, str) else (v or [])
    if any(not s for s in stops):
        raise ValueError("expected a string or a list of non-empty strings")
    return stops


class SamplingParams(BaseModel):
    """SGLang 0.5.23's SamplingParams, every field."""
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Annotated[StrictInt, Field(ge=1)] = 128
    temperature: Annotated[Number, Field(ge=0)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, AfterValidator(_top_k)] = -1  # -1 or >= the vocabulary: off
    min_p: Annotated[Number, _only(0.0)] = 0.0
    n: Annotated[StrictInt, Field(ge=1, le=1, description="one sample a prompt; send a batch for more")] = 1
    seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None = None
    sampling_seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None = None
    stop: Annotated[Union[StrictStr, list[StrictStr], None], AfterValidator(_stop)] = None
    stop_token_ids: list[StrictInt] | None = None
    stop_regex: Annotated[Union[StrictStr, list[StrictStr], None], _only(None, [], "")] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    stream_interval: StrictInt | None = None
    custom_params: dict[str, Any] | None = None  # SGLang hands these only to custom logit processors (refused)
    frequency_penalty: Annotated[Number, _only(0.0)] = 0.0
    presence_penalty: Annotated[Number, _only(0.0)] = 0.0
    repetition_penalty: Annotated[Number, _only(1.0)] = 1.0
    min_new_tokens: Annotated[StrictInt, _only(0)] = 0
    logit_bias: Annotated[dict[str, Any] | None, _only(None, {})] = None
    regex: Annotated[StrictStr | None, _only(None)] = None
    json_schema: Annotated[StrictStr | None, _only(None)] = None
    ebnf: Annotated[StrictStr | None, _only(None)] = None
    structural_tag: Annotated[StrictStr | None, _only(None)] = None
    beam_width: Annotated[StrictInt | None, _only(None, 1)] = None
    watermark: Annotated[Any, _only(None)] = None
    ebnf_full_assistant: Annotated[StrictBool, _only(False)] = False


SAMPLING_FIELDS = tuple(SamplingParams.model_fields)
# the fields accepted only at a neutral value, with that value (for errors and tests)
SAMPLING_NEUTRAL = {"min_p": (0, 0.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
                    "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "logit_bias": (None, {}), "regex": (None,),
                    "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,), "stop_regex": (None, [], ""),
                    "beam_width": (None, 1), "watermark": (None,), "ebnf_full_assistant": (False,)}

# GenerateReqInput fields this engine cannot honour, each with the values that change nothing and why
GENERATE_UNSUPPORTED = {
    "input_embeds": ((None,), "the engine takes token ids"),
    "image_data": ((None, []), "a text-only model"), "video_data": ((None, []), "a text-only model"),
    "audio_data": ((None, []), "a text-only model"), "lora_path": ((None,), "no LoRA adapters"),
    "lora_id": ((None,), "no LoRA adapters"), "custom_logit_processor": ((None,), "no custom logit processors"),
    "return_hidden_states": ((None, False), "hidden states are not returned"),
    "session_params": ((None,), "no sessions"), "token_ids_logprob": ((None,), "log-probs of chosen ids are not computed"),
    "return_indexer_topk": ((None, False), "no sparse-attention indexer"),
    "return_sampling_mask": ((None, False), "sampling masks are not returned"),
    "bootstrap_host": ((None,), "no prefill/decode disaggregation"),
    "bootstrap_room": ((None,), "no prefill/decode disaggregation"),
}


def _unsupported(name):
    neutral, why = GENERATE_UNSUPPORTED[name]
    return Annotated[Any, _only(*neutral, why=why)]


IdList = list[StrictInt]


class GenerateRequest(BaseModel):
    """The fields of SGLang's GenerateReqInput this server reads; others are ignored."""
    model_config = ConfigDict(extra="ignore")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: IdList | list[IdList] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: StrictBool | None = False
    logprob_start_len: StrictInt | list[StrictInt | None] | None = None
    top_logprobs_num: StrictInt | list[StrictInt | None] | None = None
    return_text_in_logprobs: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    stream: Annotated[StrictBool, _only(False)] = False
    return_experts: StrictBool = False
    return_routed_experts: StrictBool = False
    log_metrics: Any = None
    session_id: Any = None

    input_embeds: _unsupported("input_embeds") = None
    image_data: _unsupported("image_data") = None
    video_data: _unsupported("video_data") = None
    audio_data: _unsupported("audio_data") = None
    lora_path: _unsupported("lora_path") = None
    lora_id: _unsupported("lora_id") = None
    custom_logit_processor: _unsupported("custom_logit_processor") = None
    return_hidden_states: _unsupported("return_hidden_states") = None
    session_params: _unsupported("session_params") = None
    token_ids_logprob: _unsupported("token_ids_logprob") = None
    return_indexer_topk: _unsupported("return_indexer_topk") = None
    return_sampling_mask: _unsupported("return_sampling_mask") = None
    bootstrap_host: _unsupported("bootstrap_host") = None
    bootstrap_room: _unsupported("bootstrap_room") = None


class UpdateWeightsRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput: the fields read here (others ignored)."""
    model_config = ConfigDict(extra="ignore")

    model_path: Annotated[StrictStr, Field(min_length=1)]
    load_format: Annotated[StrictStr | None, _only(None, "auto")] = None
    weight_version: StrictStr | StrictInt | None = None
    abort_all_requests: StrictBool = False


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: StrictStr | None = None
    abort_all: StrictBool = False


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "retract"


class MemoryRequest(BaseModel):
    """SGLang's Release/ResumeMemoryOccupationReqInput: the tags (others ignored)."""
    model_config = ConfigDict(extra="ignore")

    tags: list[StrictStr] | None = None


def one_line(e: ValidationError, data: Any, prefix: str = "") -> str:
    """The first error of ``e`` (validating ``data``) as one line: ``prefix.field=value: reason``."""
    err = e.errors(include_url=False)[0]
    field = str(err["loc"][0]) if err["loc"] else ""
    name = f"{prefix}.{field}" if prefix and field else (prefix or field)
    if err["type"] == "extra_forbidden":
        return f"{prefix}: unknown field {field!r}; supported: {sorted(SAMPLING_FIELDS)}"
    if err["type"] == "missing":
        return f"{name}: required"
    value = data.get(field, err.get("input")) if isinstance(data, dict) else err.get("input")
    return f"{name}={value!r}: {err['msg'].removeprefix('Value error, ')}"
