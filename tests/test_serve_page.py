"""serve.py's page in a real browser (headless Chromium through Selenium): a prompt typed into it gets the reply the
API gives for the same conversation, greedy, and the reply carries both marks: text from drafts the target
accepted and the target's own tokens; in JSON mode, the tokens the grammar forced too. Skipped, saying why, where Chromium, its driver or selenium is missing
(.ci/run installs them)."""
import json
import shutil

import pytest

from conftest import HANG_S
from test_serve import start_server

webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
openai = pytest.importorskip("openai", reason="pip install openai")
CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


def browser():
    """Headless Chromium through its driver."""
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Debian's chromium and chromium-driver are not installed")
def test_the_page_chats_and_marks_drafted_and_target_tokens():
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    proc, url = start_server()
    driver = browser()
    try:
        driver.get(url + "/")
        prompt = "def read_lines(path):"
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "log").get_attribute("data-done") == "1")
        spans = driver.find_elements(By.CSS_SELECTOR, "#log span.drafted, #log span.target")
        shown = "".join(s.get_attribute("textContent") for s in spans)
        kinds = {s.get_attribute("class") for s in spans}
        api = openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            model="eaglet", messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0)
        assert shown == api.choices[0].message.content and shown
        assert kinds == {"drafted", "target"}
        assert "tau:" in driver.find_element(By.ID, "stats").text and "tokens/s:" in driver.find_element(By.ID, "stats").text
        # JSON mode: the reply is JSON, and the tokens the grammar forced (its quotes, colons, braces) are marked
        driver.find_element(By.ID, "json").click()
        driver.find_element(By.ID, "prompt").send_keys("Describe a file as JSON.")
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "log").get_attribute("data-done") == "2")
        spans = driver.find_elements(By.CSS_SELECTOR, "#log span")
        last_user = max(i for i, s in enumerate(spans) if s.get_attribute("class") == "user")
        reply = spans[last_user + 1:]
        assert "forced" in {s.get_attribute("class") for s in reply}
        json.loads("".join(s.get_attribute("textContent") for s in reply))
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(timeout=HANG_S)


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Debian's chromium and chromium-driver are not installed")
def test_the_page_asks_for_the_api_key_a_server_needs():
    """With --api_key the page's first request is refused (401): it asks for the key, again after a wrong one or one
    a header cannot carry (not Latin-1), and then chats with it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait
    proc, url = start_server("--api_key", "sekret")
    driver = browser()
    try:
        driver.get(url + "/")
        driver.find_element(By.ID, "prompt").send_keys("def read_lines(path):")
        driver.find_element(By.ID, "send").click()
        for key, asked in (("wrong", "needs its API key"), ("\u043a\u043b\u044e\u0447", "That key was refused"),
                           ("sekret", "That key was refused")):  # a key no header can carry: asked again
            alert = WebDriverWait(driver, 60).until(expected_conditions.alert_is_present())
            assert asked in alert.text
            alert.send_keys(key)
            alert.accept()
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "log").get_attribute("data-done") == "1")
        assert driver.find_elements(By.CSS_SELECTOR, "#log span.drafted, #log span.target")
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(timeout=HANG_S)
