"""The chat page at `/`, driven in Debian's Chromium (headless, through selenium and
chromium-driver): a streamed answer equal to the API's, stop, a conversation kept across a
reload, the API key, a phone-width screen; a screenshot of each page kept as an artifact."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(os.environ.get("CPULLM_TEST_ARTIFACTS",
                                Path(__file__).resolve().parent.parent / "test-artifacts"))
QUESTION = "What is the capital of France?"


def chromium() -> tuple[str, str]:
    """Chromium and its driver, installed from Debian's packages where they are missing
    (the suite runs as root in CI); a machine that cannot is a failure, not a skip."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if all(found):
        return found  # type: ignore[return-value]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("the browser test needs chromium and chromium-driver (Debian: apt-get "
                    "install chromium chromium-driver), and this user cannot install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode:
            pytest.fail(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    found = shutil.which("chromium"), shutil.which("chromedriver")
    assert all(found), "chromium installed, but not on PATH"
    return found  # type: ignore[return-value]


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1100,850", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    srv = RemoteServer(["--max-model-len", "2048", "--served-model-name", "default"])
    yield srv
    srv.stop()


def wait_for(condition, timeout: float = 60.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def shot(driver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def set_field(driver, element_id: str, value: str) -> None:
    """Type into a settings field as a person does (the page saves it on change)."""
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_answer(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def stored_messages(driver) -> list[dict]:
    return driver.execute_script(
        "const all = JSON.parse(localStorage.getItem('cpullm.conversations') || '[]');"
        "const id = localStorage.getItem('cpullm.current');"
        "const c = all.find((x) => x.id === id); return c ? c.messages : [];")


def test_a_streamed_answer_equals_the_apis(browser, server):
    browser.get(server.url + "/")
    info = browser.find_element("id", "model-info")
    wait_for(lambda: "context 2048" in info.text, what="the model's name and context")
    assert info.text.startswith("default")
    settings = browser.find_element("id", "settings")
    assert not settings.is_displayed()
    browser.find_element("id", "toggle-settings").click()
    assert settings.is_displayed()
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "40")
    browser.find_element("id", "toggle-settings").click()
    assert not settings.is_displayed()
    ask(browser, QUESTION)
    # streamed: the answer is on the page while it is still being written
    wait_for(lambda: last_answer(browser).get_attribute("data-state") == "streaming"
             and last_answer(browser).text.strip(), what="the first tokens")
    wait_for(lambda: last_answer(browser).get_attribute("data-state") == "done",
             what="the whole answer")
    api = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0, "top_p": 1, "max_tokens": 40}).json()
    expected = api["choices"][0]["message"]["content"]
    assert stored_messages(browser)[-1]["content"] == expected
    shown = last_answer(browser).find_element("css selector", ".content").text
    assert expected.split()[0] in shown
    stats = last_answer(browser).find_element("css selector", ".stats").text
    assert "tokens/s" in stats and "first token in" in stats
    shot(browser, "webui-answer")


def test_stop_aborts_the_request(browser, server):
    before = server.finished_by_reason()["abort"]
    browser.find_element("id", "toggle-settings").click()
    set_field(browser, "max-tokens", "1500")
    browser.find_element("id", "toggle-settings").click()
    ask(browser, "Write a very long story about a dragon who learns to cook.")
    wait_for(lambda: len(last_answer(browser).text) > 20, what="the answer to start")
    browser.find_element("id", "stop").click()
    wait_for(lambda: last_answer(browser).get_attribute("data-state") == "done",
             what="the stopped answer")
    assert "Stopped." in last_answer(browser).text
    wait_for(lambda: server.finished_by_reason()["abort"] == before + 1, timeout=20,
             what="/metrics to count the abort")
    server.wait_idle()  # no request left, every KV block free


def test_the_conversation_survives_a_reload(browser, server):
    before = stored_messages(browser)
    browser.refresh()
    wait_for(lambda: browser.find_elements("css selector", ".message"), what="the messages")
    assert len(browser.find_elements("css selector", ".message")) == len(before) == 4
    assert QUESTION in browser.find_element("id", "messages").text
    assert browser.find_element("id", "conversations").text.startswith(QUESTION[:40])
    browser.find_element("id", "new-chat").click()
    assert not browser.find_elements("css selector", ".message")
    assert len(browser.find_elements("css selector", "#conversations li")) == 2


def test_an_error_is_shown_in_the_conversation(browser, server):
    browser.find_element("id", "toggle-settings").click()
    set_field(browser, "max-tokens", "5000")  # more than the context
    browser.find_element("id", "toggle-settings").click()
    ask(browser, "Hello")
    wait_for(lambda: last_answer(browser).get_attribute("data-state") == "done",
             what="the refused answer")
    error = last_answer(browser).find_element("css selector", ".error").text
    assert error.startswith("400:") and "maximum context length" in error


def test_a_phone_screen(browser, server):
    browser.set_window_size(390, 844)
    try:
        browser.get(server.url + "/")
        toggle = browser.find_element("id", "toggle-sidebar")
        assert toggle.is_displayed()
        assert not browser.find_element("id", "sidebar").is_displayed()
        assert browser.find_element("id", "prompt").is_displayed()
        shot(browser, "webui-phone")
        toggle.click()
        assert browser.find_element("id", "sidebar").is_displayed()
        browser.find_elements("css selector", "#conversations .open")[-1].click()
        assert not browser.find_element("id", "sidebar").is_displayed()
        assert QUESTION in browser.find_element("id", "messages").text
    finally:
        browser.set_window_size(1100, 850)


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    from server_utils import RemoteServer

    srv = RemoteServer([str(tiny_model("llama")), "--max-model-len", "256", "--api-key",
                        "page-key"])
    yield srv
    srv.stop()


def test_the_page_asks_for_the_api_key(browser, keyed_server):
    browser.get(keyed_server.url + "/")
    info = browser.find_element("id", "model-info")
    wait_for(lambda: "needs an API key" in info.text, what="the key request")
    assert browser.find_element("id", "settings").is_displayed()
    set_field(browser, "api-key", "page-key")
    wait_for(lambda: "context 256" in info.text, what="the model, with the key")


HTML = {"Accept": "text/html,application/xhtml+xml"}


def test_api_clients_get_json_and_the_page_its_files(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/").json()["routes"]["messages"] == "/v1/messages"
    assert httpx.get(url + "/", headers=HTML).headers["content-type"].startswith("text/html")
    for name in ("app.js", "style.css"):  # open, as / is: the key guards the API only
        assert httpx.get(f"{url}/webui/{name}").status_code == 200
    assert httpx.get(f"{url}/webui/..%2fapi_server.py").status_code == 404


def test_no_webui_answers_json(tiny_model):
    from server_utils import RemoteServer

    srv = RemoteServer([str(tiny_model("llama")), "--max-model-len", "256", "--no-webui"])
    try:
        assert httpx.get(srv.url + "/", headers=HTML).json()["name"] == "cpullm"
        assert httpx.get(f"{srv.url}/webui/app.js").status_code == 404
    finally:
        srv.stop()
