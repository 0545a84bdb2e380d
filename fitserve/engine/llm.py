"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, with vLLM's names."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from fitserve.args import EngineArgs, engine_args_from_kwargs
from fitserve.core.outputs import RequestOutput
from fitserve.core.sampling_params import RequestOutputKind, SamplingParams
from fitserve.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    check_beam_width,
    decoder,
    run_beam_search,
)
from fitserve.engine.engine import Engine
from fitserve.planner.resolve import create_engine_config

PromptType = str | dict[str, Any]
Conversation = list[dict[str, Any]]

logger = logging.getLogger("fitserve")


class LLM:
    """An engine in this process. `model=None` serves the default SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: engine arguments by vLLM's names (fitserve/args.py), e.g. max_model_len=4096. What is
        not given is chosen by the planner, exactly as `fitserve serve` would for the same flags."""
        self.engine = Engine(create_engine_config(engine_args_from_kwargs(model, kwargs)))
        self._next_request_id = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = Engine(create_engine_config(args))
        llm._next_request_id = 0
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._final_only(self._params_per_prompt(sampling_params, len(prompts)))
        # Validate everything before anything is queued: a bad prompt leaves the engine untouched.
        requests = [self._split_prompt(p) for p in prompts]
        for _text, token_ids in requests:
            if token_ids is not None:
                self.engine.validate_prompt(token_ids)
        for params in params_list:
            params.check_token_ids(self.engine.config.model.vocab_size)
        request_ids = []
        for (text, token_ids), params in zip(requests, params_list):
            request_id = str(self._next_request_id)
            self._next_request_id += 1
            self.engine.add_request(request_id, text, token_ids, params)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt, the best `params.beam_width` sequences, best first
        (fitserve/engine/beam_search.py has the rules). `use_tqdm` is accepted for vLLM's signature."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenizer = self.engine.tokenizer
        check_beam_width(params.beam_width, self.engine.config.model.vocab_size)
        prompt_ids = []
        for prompt in prompts:
            text, token_ids = self._split_prompt(prompt)
            if token_ids is None:
                token_ids = list(tokenizer.encode(text, add_special_tokens=True))
            self.engine.validate_prompt(token_ids)
            prompt_ids.append(token_ids)
        max_model_len = self.engine.config.model.max_model_len
        searches = [BeamSearch(ids, params, self.engine.eos_token_ids, max_model_len) for ids in prompt_ids]
        prefix = f"beam{self._next_request_id}"
        self._next_request_id += 1
        run_beam_search(self.engine, searches, prefix)
        return [search.output(decoder(tokenizer)) for search in searches]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template: pass chat_template=... "
                "or use generate() with a plain prompt"
            )
        prompts: list[PromptType] = []
        for conversation in conversations:
            token_ids = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
            if isinstance(token_ids, dict) or hasattr(token_ids, "keys"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(
                f"got {len(params_list)} SamplingParams for {count} prompts: pass one, or one per prompt"
            )
        return params_list

    @staticmethod
    def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
        """The offline API reads only finished outputs: ask the engine for nothing else."""
        converted: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in converted:
                converted[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        return [converted[id(p)] for p in params_list]

    @staticmethod
    def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], None
        raise ValueError(
            "a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps until every request is finished. A request the engine ended with an error (its step ran
        out of GPU memory; the engine logs the message when it happens) comes back with finish_reason
        "error" and `.error` set, the other requests complete, and one line at the end counts them."""
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        started = time.perf_counter()
        input_tokens = output_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    input_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(
                        f"est. speed input: {input_tokens / elapsed:.2f} toks/s, "
                        f"output: {output_tokens / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        failed = [r for r in request_ids if finished[r].error is not None]
        if failed:
            logger.warning(
                '%d of %d request(s) ended with an error (finish_reason "error"; the message is in their '
                "output's .error): %s",
                len(failed),
                len(request_ids),
                ", ".join(failed[:5]) + (", ..." if len(failed) > 5 else ""),
            )
        return [finished[r] for r in request_ids]
