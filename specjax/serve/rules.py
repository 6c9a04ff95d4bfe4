"""What a server accepts from a request: `RequestRules` validates it against the shapes fixed at
start-up, and turns its per-request controls (speculation off, a method override) into the row's
draft limit and, on an adaptive server, the batch policy it pins."""

from __future__ import annotations

import dataclasses

from specjax.decode import slots as slot_api
from specjax.decode.sampling import SamplingConfig
from specjax.errors import SpecjaxError
from specjax.io.registry import LoadedModel
from specjax.serve.config import ServeConfig
from specjax.serve.requests import Request
from specjax.serve.shapes import ServingShapes


class RequestRules:
    """The checks and per-request limits of one server."""

    def __init__(self, shapes: ServingShapes, model: LoadedModel, config: ServeConfig, has_drafter: bool):
        self.shapes, self.statics, self.policies = shapes, shapes.statics, shapes.policies
        self.model, self.config, self.has_drafter = model, config, has_drafter
        self.drafts_from_retrieval = shapes.drafts_from_retrieval

    def validate(self, request: Request) -> None:
        """Refuse a request the engine cannot serve, with a message saying why."""
        if not request.prompt:
            raise SpecjaxError("the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt if not 0 <= int(t) < vocab]
        if bad:
            raise SpecjaxError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not 1 <= request.max_tokens <= self.config.max_new_tokens:
            raise SpecjaxError(f"max_tokens must be in [1, {self.config.max_new_tokens}], got {request.max_tokens}")
        if len(request.prompt) > self.shapes.max_prompt:
            raise SpecjaxError(f"the prompt has {len(request.prompt)} tokens; this server takes at most "
                               f"{self.shapes.max_prompt}")
        if len(request.prompt) + request.max_tokens + self.shapes.step_slack > self.config.context_length:
            raise SpecjaxError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                               f"the context of {self.config.context_length - self.shapes.step_slack} tokens")
        SamplingConfig(request.temperature, request.top_k, request.top_p)  # refuses bad values, naming them
        if self.drafts_from_retrieval:
            drafting = self.with_drafting_prompt(request).drafting_prompt
            bad = [t for t in drafting if not 0 <= int(t) < vocab]
            if not drafting or bad:
                raise SpecjaxError("the drafting prompt is empty" if not drafting else
                                   f"drafting prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            if len(drafting) + request.max_tokens > self.shapes.max_drafting_prompt:
                raise SpecjaxError(f"drafting prompt ({len(drafting)} tokens) + max_tokens ({request.max_tokens}) "
                                   f"exceeds the drafting context of {self.shapes.max_drafting_prompt} tokens "
                                   f"(ServeConfig.drafting_length, serve --drafting-length)")
        if request.stop and self.model.tokenizer is None:
            raise SpecjaxError("stop strings need a tokenizer; this model has none")
        if any(not s for s in request.stop):
            raise SpecjaxError("a stop string is empty")
        self.row_limit(request)  # refuses a method this server cannot run

    def served_name(self, method: str | None) -> str | None:
        """A request's method as this server runs it: with a block-16 drafter, "chain" is "chain:7"
        on a target padded to 8 query rows (slots.method_within_query_rows)."""
        if method is None or not self.has_drafter or not slot_api.slot_method(method).speculates:
            return method
        return slot_api.method_within_query_rows(method, self.statics.block, self.model.config.query_rows)

    def row_limit(self, request: Request) -> int:
        """The request's draft limit: 0 without speculation, K for a "chain:K" override, else none."""
        no_limit = self.statics.block - 1
        method = self.served_name(request.method)
        if method is not None:
            allowed = set(self.policies) | {"ar"}
            for served in map(slot_api.slot_method, self.policies):
                if served.takes_draft_limit:  # per-row draft limits
                    allowed |= {served.limited_to(k) for k in range(1, self.statics.block)}
            if method not in allowed:
                raise SpecjaxError(f"method {method!r} is not served here; this server runs "
                                   f"{', '.join(sorted(allowed))}")
        if not request.speculation or (method is not None and not slot_api.slot_method(method).speculates):
            return 0
        drafts = None if method is None else slot_api.slot_method(method).drafts
        return no_limit if drafts is None else min(drafts, no_limit)

    def pin_for(self, request: Request, adaptive: bool, drafts_of: dict[str, int | None]) -> str | None:
        """The batch policy a request's override pins on an adaptive server: the method itself, or for
        "chain:K" the shortest compiled chain verifying at least K drafts (the row is limited to K).
        "ar" pins nothing: the row's limit of 0 makes it AR inside any step."""
        method = self.served_name(request.method)
        if not adaptive or method is None or not slot_api.slot_method(method).speculates:
            return None
        if method in self.policies:
            return method
        family, drafts = slot_api.slot_method(method).family, self.row_limit(request)
        length = lambda p: drafts_of[p] or 0  # noqa: E731
        chains = [p for p in self.policies if slot_api.slot_method(p).family == family]
        covering = [p for p in chains if length(p) >= drafts]
        return min(covering, key=length) if covering else max(chains, key=length)

    def with_drafting_prompt(self, request: Request) -> Request:
        """On a rapid or rapid+block server, a request without a drafting prompt drafts from its
        prompt's most recent tokens, as many as the drafting context holds beside its answer."""
        if not self.drafts_from_retrieval or request.drafting_prompt is not None:
            return request
        room = max(self.shapes.max_drafting_prompt - request.max_tokens, 1)
        return dataclasses.replace(request, drafting_prompt=tuple(request.prompt[-room:]))
