"""The registered chat model behind `mlflow models serve`: a chat prompt answered with text, reasoning and answer;
input that is not a prompt, params that are unknown, of the wrong type or out of range, prompts longer than the
model's context leaves them and more prompts than it serves at once refused with HTTP 400 and a message naming them;
and the request checks themselves."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import ROOT, run_env
from helpers import free_port
from lora_pipeline.data import builtin as builtin_data
from lora_pipeline.registry.serving import (Context, GENERATION_DEFAULTS, check_prompt_lengths, checked_generation,
                                            checked_prompts, model_context)

PROMPT = "<|im_start|>user\nAnna hat 5 Äpfel und kauft 3 dazu.<|im_end|>\n<|im_start|>assistant\n"
ALLOWED = "allowed: max_new_tokens, do_sample, temperature, top_p"


@pytest.mark.parametrize("prompts, message", [
    ([123], "inputs[0]: a prompt must be a string (rendered with the model's chat template), got int 123"),
    ([PROMPT, None], "inputs[1]: a prompt must be a string (rendered with the model's chat template), got null"),
    ([PROMPT, ["nested"]], "inputs[1]: a prompt must be a string"),
    ([], "inputs: no prompts"),
    ([""], "inputs[0]: the prompt is empty"),
    ([PROMPT, " \n"], "inputs[1]: the prompt is empty"),
])
def test_prompts_must_be_strings_that_are_not_empty(prompts, message):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="^" + re.escape(message)) as error:
        checked_prompts(prompts)
    assert error.value.get_http_status_code() == 400


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 8}, f"params: unknown 'max_tokens'; {ALLOWED}"),
    ({"max_new_tokens": 0}, "params.max_new_tokens must be a whole number of at least 1, got int 0"),
    ({"max_new_tokens": "many"}, "params.max_new_tokens must be a whole number of at least 1, got str 'many'"),
    ({"max_new_tokens": 2.5}, "params.max_new_tokens must be a whole number of at least 1, got float 2.5"),
    ({"max_new_tokens": True}, "params.max_new_tokens must be a whole number"),
    ({"do_sample": "yes"}, "params.do_sample must be true or false, got str 'yes'"),
    ({"temperature": "hot"}, "params.temperature must be a number, got str 'hot'"),
    ({"do_sample": True, "temperature": 0.0}, "params.temperature must be above 0 with do_sample, got 0.0"),
    ({"do_sample": True, "top_p": 1.5}, "params.top_p must be above 0 and at most 1 with do_sample, got 1.5"),
])
def test_generation_params_refused_naming_the_param(params, message):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="^" + re.escape(message)) as error:
        checked_generation(params)
    assert error.value.get_http_status_code() == 400


def test_limits_of_the_model_are_refused_naming_the_limit():
    from mlflow.exceptions import MlflowException

    context = Context(1024, "max_position_embeddings")
    cases = [
        (lambda: checked_prompts([PROMPT] * 9, max_prompts=8),
         "inputs: 9 prompts; this model serves at most 8 per request"),
        (lambda: checked_generation({"max_new_tokens": 1_000_000_000}, context),
         "params.max_new_tokens 1000000000 leaves no room for a prompt in this model's context of 1024 tokens "
         "(max_position_embeddings in its config); at most 1023"),
        (lambda: check_prompt_lengths([10, 1000], 100, context),
         "inputs[1]: the prompt is 1000 tokens; this model's context of 1024 tokens (max_position_embeddings in its "
         "config) less max_new_tokens 100 leaves at most 924 tokens for a prompt"),
    ]
    for refused, message in cases:
        with pytest.raises(MlflowException, match="^" + re.escape(message)) as error:
            refused()
        assert error.value.get_http_status_code() == 400
    assert checked_prompts([PROMPT] * 8, max_prompts=8) == [PROMPT] * 8
    assert checked_generation({"max_new_tokens": 1023}, context)["max_new_tokens"] == 1023
    check_prompt_lengths([924, 1], 100, context)  # the prompt and its new tokens fill the context exactly


def test_context_comes_from_the_model_config():
    from transformers import AutoConfig, PretrainedConfig

    assert model_context(AutoConfig.for_model("qwen2", max_position_embeddings=2048)) == \
        Context(2048, "max_position_embeddings")
    # gpt2 calls it n_positions; its config answers to max_position_embeddings too
    assert model_context(AutoConfig.for_model("gpt2", n_positions=512)).tokens == 512
    assert model_context(PretrainedConfig()) is None  # a config that states none: no length check


def test_good_requests_pass_with_defaults_filled_in():
    assert checked_prompts([PROMPT, "x"]) == [PROMPT, "x"]
    assert checked_generation(None) == GENERATION_DEFAULTS
    assert checked_generation({"max_new_tokens": None}) == GENERATION_DEFAULTS  # null: the default
    # temperature and top_p apply only when sampling: greedy decoding takes temperature 0 as callers often send it
    assert checked_generation({"temperature": 0})["temperature"] == 0.0
    assert checked_generation({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 4}) == \
        {"max_new_tokens": 4, "do_sample": True, "temperature": 0.7, "top_p": 0.9}


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A tiny Qwen2 built by the project's own builder (fetch's), its context 512 tokens (more than the default
    max_new_tokens), logged by register's own code into a sqlite registry of its own, as tiny-chat@champion.
    -> (tracking URI, folder)"""
    from types import SimpleNamespace

    import mlflow

    from lora_pipeline.config.params import validate
    from lora_pipeline.registry.serving import log_merged_model
    from lora_pipeline.model.tiny import build_tiny

    folder = tmp_path_factory.mktemp("serving")
    params = validate(yaml.safe_load((ROOT / "params.yaml").read_text()))
    model_dir = folder / "merged"
    # untrained, its weights spread wide: with the usual small spread, tied embeddings make greedy decoding repeat
    # the prompt's last token (a newline), and the answer would be blank
    tiny = SimpleNamespace(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           initializer_range=0.5, pretrain_steps=0, seed=0)
    build_tiny("tiny-qwen2", builtin_data.generate(200, seed=0), tiny, model_dir)

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.create_experiment("serving", artifact_location=(folder / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=experiment):
            info = log_merged_model(model_dir, params.model, params.quantization, params.register.serve_batch_size)
        version = mlflow.register_model(info.model_uri, "tiny-chat")
        mlflow.MlflowClient().set_registered_model_alias("tiny-chat", "champion", version.version)
    finally:
        mlflow.set_tracking_uri(before)
    return uri, folder


@pytest.fixture(scope="module")
def server(registered):
    """`mlflow models serve` of tiny-chat@champion on 127.0.0.1, once it answers /ping. -> base URL"""
    uri, folder = registered
    port = free_port()
    log_path = folder / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/tiny-chat@champion",
             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
            cwd=folder, env=run_env(MLFLOW_TRACKING_URI=uri), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:  # as long as loading takes, unless the server exits
            if process.poll() is not None:
                pytest.fail(f"mlflow models serve exited {process.returncode}:\n{log_path.read_text()[-6000:]}")
            try:
                # a timeout per try, not on the wait: a server that accepts but never answers is asked again
                with urllib.request.urlopen(f"{url}/ping", timeout=10) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:  # a server that ignores SIGTERM must not hold the test run
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def post(url: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of POST /invocations."""
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_served_model_answers_a_chat_prompt(server):
    status, answer = post(server, {"inputs": [PROMPT], "params": {"max_new_tokens": 8}})
    assert status == 200, answer
    [row] = answer["predictions"]
    assert set(row) == {"text", "reasoning", "answer"} and all(isinstance(v, str) for v in row.values())
    assert row["text"].strip()
    status, again = post(server, {"inputs": [PROMPT, PROMPT], "params": {"max_new_tokens": 8}})
    assert status == 200 and again["predictions"] == [row, row]  # greedy by default


@pytest.mark.parametrize("body, named", [
    ({"inputs": [123]}, "inputs[0]: a prompt must be a string"),
    ({"inputs": [PROMPT, 7.5]}, "inputs[1]: a prompt must be a string"),
    ({"inputs": [PROMPT], "params": {"max_tokens": 8}}, f"params: unknown 'max_tokens'; {ALLOWED}"),
    ({"inputs": [PROMPT], "params": {"max_new_tokens": 0}}, "params.max_new_tokens must be a whole number"),
    ({"inputs": [PROMPT], "params": {"max_new_tokens": "many"}}, "'max_new_tokens'"),
    ({"inputs": [PROMPT], "params": {"do_sample": True, "temperature": 0}}, "params.temperature must be above 0"),
    ({"inputs": []}, "missing inputs"),
    ({"inputs": [""]}, "inputs[0]: the prompt is empty"),
])
def test_served_model_refuses_bad_requests_with_400(server, body, named):
    status, answer = post(server, body)
    assert status == 400, answer
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE" and named in answer["message"], answer["message"]


def test_loaded_model_refuses_the_same_in_python(registered):
    import mlflow
    from mlflow.exceptions import MlflowException

    uri, _ = registered
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model("models:/tiny-chat@champion")
    finally:
        mlflow.set_tracking_uri(before)
    with pytest.raises(MlflowException, match=r"inputs\[1\]: a prompt must be a string"):
        model.predict([PROMPT, 123])
    with pytest.raises(MlflowException, match=r"params: unknown 'max_tokens'"):
        model.predict([PROMPT], params={"max_tokens": 8})
    assert list(model.predict([PROMPT], params={"max_new_tokens": 2}).columns) == ["text", "reasoning", "answer"]
    # the most prompts a request may hold travels with the model
    limit = yaml.safe_load((ROOT / "params.yaml").read_text())["register"]["serve_batch_size"]
    assert model.model_config["serve_batch_size"] == limit
    with pytest.raises(MlflowException, match=rf"inputs: {limit + 1} prompts; this model serves at most {limit} "):
        model.predict([PROMPT] * (limit + 1))


def long_prompt(folder, at_least: int) -> tuple[str, int]:
    """A chat prompt of at least `at_least` tokens of the served model's tokenizer -> (prompt, its tokens)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "merged")
    question = "Anna hat 5 Äpfel und kauft 3 dazu."
    while True:
        prompt = PROMPT.replace("Anna hat 5 Äpfel und kauft 3 dazu.", question)
        if (tokens := len(tokenizer(prompt, add_special_tokens=False)["input_ids"])) >= at_least:
            return prompt, tokens
        question += " Wie viele hat sie?"


def test_served_model_refuses_a_prompt_longer_than_its_context_leaves(server, registered):
    """The tiny model's context is 512 tokens: a prompt and the new tokens asked for must fit in it together."""
    _, folder = registered
    prompt, tokens = long_prompt(folder, 400)
    assert tokens < 512
    status, answer = post(server, {"inputs": [PROMPT, prompt], "params": {"max_new_tokens": 512 - tokens}})
    assert status == 200, answer
    status, answer = post(server, {"inputs": [PROMPT, prompt], "params": {"max_new_tokens": 513 - tokens}})
    assert status == 400, answer
    named = (f"inputs[1]: the prompt is {tokens} tokens; this model's context of 512 tokens (max_position_embeddings "
             f"in its config) less max_new_tokens {513 - tokens} leaves at most {tokens - 1} tokens for a prompt")
    assert named in answer["message"], answer
    status, answer = post(server, {"inputs": [PROMPT.replace("Anna", "x" * 100_000)], "params": {"max_new_tokens": 8}})
    assert status == 400 and "context of 512 tokens" in answer["message"], answer


def test_served_model_bounds_max_new_tokens_by_its_context(server):
    status, answer = post(server, {"inputs": [PROMPT], "params": {"max_new_tokens": 1_000_000_000}})
    assert status == 400, answer
    assert "params.max_new_tokens 1000000000 leaves no room for a prompt in this model's context of 512 tokens" \
        in answer["message"] and "at most 511" in answer["message"], answer


def test_served_model_takes_at_most_its_batch_of_prompts(server):
    """register.serve_batch_size, logged in the model's config, bounds a request."""
    limit = yaml.safe_load((ROOT / "params.yaml").read_text())["register"]["serve_batch_size"]
    status, answer = post(server, {"inputs": [PROMPT] * limit, "params": {"max_new_tokens": 2}})
    assert status == 200 and len(answer["predictions"]) == limit, answer
    status, answer = post(server, {"inputs": [PROMPT] * (limit + 1), "params": {"max_new_tokens": 2}})
    assert status == 400, answer
    named = f"inputs: {limit + 1} prompts; this model serves at most {limit} per request"
    assert named in answer["message"], answer
