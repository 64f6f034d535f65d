"""The chat page (GET /) in headless Chromium against the live server: streaming, the kept
conversation, Stop, error display, the SSE parser, and replies rendered as sanitized Markdown
with highlighted, copyable code (the vendored libraries served from /static, no CDN)."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("NANOINFER_CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (set NANOINFER_CHROMIUM)", allow_module_level=True)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, live_server):
    """A fresh page (its own storage) on the chat page; `page.chat_requests` collects the JSON
    bodies it posts to /v1/chat/completions."""
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.chat_requests = []
    page.on("request", lambda r: page.chat_requests.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") else None)
    page.goto(live_server.url + "/")
    yield page
    context.close()


def set_sampling(page, *, temperature="0", max_tokens="24", seed="1", top_p="1"):
    page.fill("#temperature", temperature)
    page.fill("#top-p", top_p)
    page.fill("#max-tokens", max_tokens)
    page.fill("#seed", seed)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator("#messages .msg.assistant").last


def wait_finished(page, state="done") -> str:
    """The last reply's text as it streamed in (its Markdown source; the page shows it rendered)."""
    reply = last_reply(page)
    sync_api.expect(reply).to_have_attribute("data-state", state, timeout=TIMEOUT_MS)
    sync_api.expect(page.locator("#send")).to_be_enabled()
    return reply.get_attribute("data-source")


def post_chat(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_page_serves_model_name(page):
    assert "tiny-chat" in page.title()
    assert "{{MODEL}}" not in page.content()


def test_streamed_reply_equals_greedy_completion(page, live_server):
    set_sampling(page, temperature="0", max_tokens="32", seed="3")
    send(page, "Hello <b>there</b> & welcome")
    text = wait_finished(page)

    [body] = page.chat_requests
    assert body["stream"] is True and body["max_tokens"] == 32 and body["temperature"] == 0 and body["seed"] == 3
    assert body["messages"] == [{"role": "user", "content": "Hello <b>there</b> & welcome"}]
    status, expected = post_chat(live_server.url, {k: body[k] for k in ("messages", "max_tokens", "temperature", "seed")})
    assert status == 200
    assert text and text == expected["choices"][0]["message"]["content"]
    # The user's text is shown as text, not markup.
    assert page.locator("#messages .msg.user .content").text_content() == "Hello <b>there</b> & welcome"
    assert page.locator("#messages b").count() == 0
    assert page.input_value("#prompt") == ""


def test_second_turn_sends_the_whole_conversation(page, live_server, tmp_path):
    set_sampling(page, temperature="0", max_tokens="20")
    send(page, "What is a paged KV cache?")
    first = wait_finished(page)
    page.fill("#prompt", "And why\nblocks?")  # a newline typed with Shift+Enter must not send
    page.press("#prompt", "Shift+Enter")
    assert len(page.chat_requests) == 1
    page.click("#send")
    second = wait_finished(page)

    assert page.chat_requests[1]["messages"] == [
        {"role": "user", "content": "What is a paged KV cache?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And why\nblocks?\n"},
    ]
    assert page.locator("#messages .msg").count() == 4 and second

    shot = tmp_path / "chat_page.png"
    page.screenshot(path=str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "chat_page.png")

    page.click("#new-chat")
    assert page.locator("#messages .msg").count() == 0
    send(page, "Fresh start")
    wait_finished(page)
    assert page.chat_requests[2]["messages"] == [{"role": "user", "content": "Fresh start"}]


def test_stop_aborts_and_keeps_partial_text(page, live_server):
    set_sampling(page, temperature="1", max_tokens="1500", seed="5")
    send(page, "Tell me a very long story.")
    reply = last_reply(page)
    sync_api.expect(reply).not_to_have_attribute("data-source", "", timeout=TIMEOUT_MS)
    sync_api.expect(reply).to_have_attribute("data-state", "streaming")
    page.click("#stop")
    partial = wait_finished(page, "stopped")
    assert partial
    assert page.locator("#stop").is_disabled()
    assert page.locator("#error").is_hidden()

    # The server saw the client leave and aborted the request.
    deadline = time.monotonic() + 10
    while live_server.engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_server.engine.num_in_flight == 0
    assert reply.get_attribute("data-source") == partial

    # The partial reply stays in the conversation.
    set_sampling(page, max_tokens="4")
    send(page, "Go on")
    wait_finished(page)
    assert page.chat_requests[1]["messages"][1] == {"role": "assistant", "content": partial}


def test_error_response_is_shown_and_turn_restored(page, live_server):
    set_sampling(page, max_tokens="-5")
    send(page, "This will fail")
    error = page.locator("#error")
    sync_api.expect(error).to_be_visible(timeout=TIMEOUT_MS)
    status, expected = post_chat(live_server.url, page.chat_requests[0])
    assert status == 400
    assert error.text_content() == expected["error"]["message"]
    assert "max_tokens" in error.text_content()
    sync_api.expect(page.locator("#send")).to_be_enabled()
    # Nothing came back, so the turn is taken back for a retry with fixed settings.
    assert page.locator("#messages .msg").count() == 0
    assert page.input_value("#prompt") == "This will fail"

    set_sampling(page, max_tokens="4")
    page.click("#send")
    wait_finished(page)
    assert error.is_hidden()
    assert page.chat_requests[1]["messages"] == [{"role": "user", "content": "This will fail"}]


def test_sse_parser_handles_splits_across_reads(page):
    # Reads that end mid-line, mid-"data:" and inside a UTF-8 character (é is C3 A9, 😀 is 4 bytes).
    stream = 'data: {"a":"é"}\n\ndata: {"b":"😀"}\r\n\r\n: comment\n\ndata: [DONE]\n\ndata: {"after":1}\n\n'
    raw = list(stream.encode())
    cuts = [3, 14, 15, 27, 29, 30, 45, 60]
    pieces = [raw[i:j] for i, j in zip([0, *cuts], [*cuts, len(raw)])]
    got = page.evaluate("""async (pieces) => {
        const body = new ReadableStream({start(c) { for (const p of pieces) c.enqueue(new Uint8Array(p)); c.close(); }});
        const out = [];
        await readSSE(body, (data) => out.push(data));
        return out;
    }""", pieces)
    assert got == ['{"a":"é"}', '{"b":"😀"}']


MARKDOWN_REPLY = ("**Bold** and `inline`, a [link](javascript:window.pwned=1) and <img src=x onerror=\"window.pwned=1\">"
                  "<script>window.pwned=1</script>\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n- one\n- two")


def test_replies_render_as_sanitized_markdown_with_copyable_code(page, browser):
    """A reply (served here by a stubbed stream, in small pieces) shows as Markdown: emphasis,
    lists, a highlighted code block with a Copy button that copies its code; the model's
    script, event handler and javascript: link do not survive. Nothing is fetched from
    outside the server."""
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    pieces = [MARKDOWN_REPLY[i:i + 7] for i in range(0, len(MARKDOWN_REPLY), 7)]
    events = "".join("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": p}}]}) + "\n\n"
                     for p in pieces) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=events,
                                                                    headers={"Content-Type": "text/event-stream"}))
    outside = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(page.url.rstrip("/")) else None)
    send(page, "Show me some Markdown")
    assert wait_finished(page) == MARKDOWN_REPLY
    content = last_reply(page).locator(".content")
    assert content.locator("strong").text_content() == "Bold"
    assert content.locator("li").count() == 2
    code = content.locator("pre code.hljs")
    assert code.text_content() == "def add(a, b):\n    return a + b\n"
    assert code.locator("span[class^=hljs-]").count() > 0  # highlighted
    assert content.locator("script, img[onerror], a[href^=javascript]").count() == 0
    assert page.evaluate("window.pwned") is None
    content.locator("pre button.copy").click()
    sync_api.expect(content.locator("pre button.copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b\n"
    assert not outside
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_markdown.png"))



def test_system_prompt_regenerate_edit_last_tokens_per_second_and_reload(page, live_server):
    set_sampling(page, temperature="0", max_tokens="8")
    page.fill("#system", "Be brief.")
    send(page, "Hi")
    first = wait_finished(page)
    system = {"role": "system", "content": "Be brief."}
    assert page.chat_requests[0]["messages"] == [system, {"role": "user", "content": "Hi"}]
    assert page.chat_requests[0]["stream_options"] == {"include_usage": True}
    stats = last_reply(page).locator(".stats").text_content()
    assert stats.startswith("8 tokens · ") and stats.endswith(" tokens/s"), stats

    page.click("#regenerate")  # the same conversation again, the old reply replaced
    assert wait_finished(page) == first  # (greedy)
    assert page.chat_requests[1]["messages"] == page.chat_requests[0]["messages"]
    assert page.locator("#messages .msg").count() == 2

    page.click("#edit-last")  # the user's turn back in the box, its reply gone
    assert page.locator("#messages .msg").count() == 0 and page.input_value("#prompt") == "Hi"
    page.fill("#prompt", "Hello again")
    page.press("#prompt", "Enter")
    second = wait_finished(page)

    page.reload()  # the conversation and system prompt survive it
    assert page.input_value("#system") == "Be brief."
    assert page.locator("#messages .msg.user .content").all_text_contents() == ["Hello again"]
    assert last_reply(page).get_attribute("data-source") == second
    assert last_reply(page).locator(".stats").text_content().endswith(" tokens/s")
    page.chat_requests.clear()
    set_sampling(page, temperature="0", max_tokens="4")
    send(page, "More")
    wait_finished(page)
    assert page.chat_requests[0]["messages"] == [system, {"role": "user", "content": "Hello again"},
                                                 {"role": "assistant", "content": second},
                                                 {"role": "user", "content": "More"}]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_page_features.png"))
