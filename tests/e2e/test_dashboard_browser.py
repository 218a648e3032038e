"""The dashboard in a real browser: headless Debian Chromium, driven by Selenium, against a
live `openrl serve` where the real tinker SDK has trained a run. Another tenant's key shows
no runs; the run's key shows the run and its session; its page draws one loss point per step
with exactly the losses the SDK got, sampling throughput per step and per request as the API
reports it, and the timeslicer's turns; a step taken while the page is open arrives on the
live stream; Fork at step 3 shows the fork's run id and `tinker://` path, and the API has
that fork; Cancel cancels the run (the page and the API agree) and its checkpoint stays.
Screenshots are kept under the test's tmp dir and copied to out/screenshots/ (git-ignored).

Chromium comes from scripts/ensure-chromium (apt); the test skips, saying why, only where
this machine has no apt-get to install it with.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from urllib.parse import unquote

import httpx
import pytest
import tinker
from tinker import types

from functions.local_server import REPO, LocalServer

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
ALICE, BOB, OPERATOR = "tml-dash-alice", "tml-dash-bob", "tml-dash-operator"
LEARNING_RATES = (1e-3, 2e-3, 3e-3)
WAIT = 20


@pytest.fixture(scope="module")
def chromium():
    setup = subprocess.run([str(REPO / "scripts" / "ensure-chromium")], capture_output=True, text=True)
    if setup.returncode == 2:
        pytest.skip(f"no Chromium, and no apt-get to install it: {setup.stderr.strip()}")
    assert setup.returncode == 0, f"scripts/ensure-chromium failed:\n{setup.stdout}\n{setup.stderr}"
    return shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-dashboard"), [MODEL], f"alice={ALICE},bob={BOB}",
        extra_env={"OPENRL_OPERATOR_API_KEY": OPERATOR, "TINKER_TELEMETRY": "0"},
    ) as srv:  # fmt: skip
        yield srv


def batch_of(tokenizer) -> list[types.Datum]:
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


@pytest.fixture
def browser(chromium, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1800",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):  # fmt: skip
        options.add_argument(flag)
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(tmp_path / "downloads"), "download.prompt_for_download": False}
    )
    # The driver path given: Selenium Manager would otherwise try to download one.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, tmp_path, name: str) -> None:
    path = tmp_path / name
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    keep = REPO / "out" / "screenshots"
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, keep / name)


def test_the_dashboard_shows_a_live_run_and_cancels_it(server, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    sdk = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    training = sdk.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    batch = batch_of(training.get_tokenizer())
    losses = []
    for step, lr in enumerate(LEARNING_RATES, start=1):
        losses.append(training.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        if step == 3:  # a sample between steps 2 and 3 (step 3's window), and one after step 3 (no step's yet)
            kept = training.save_weights_for_sampler("dash").result().path
            sampler = sdk.create_sampling_client(model_path=kept).result()
            sampler.sample(batch[0].model_input, 1, types.SamplingParams(max_tokens=4, seed=1)).result()
        training.optim_step(types.AdamParams(learning_rate=lr)).result()
    sampler.sample(batch[0].model_input, 1, types.SamplingParams(max_tokens=4, seed=2)).result()
    run = training.model_id
    api = lambda path: httpx.get(f"{server.url}/api/openrl/v1{path}", headers={"X-API-Key": ALICE}).json()  # noqa: E731
    session_id = api(f"/runs/{run}")["run"]["session_id"]
    bob_run = (
        tinker.ServiceClient(base_url=server.url, api_key=BOB)
        .create_lora_training_client(base_model=MODEL, rank=4)
        .result()
        .model_id
    )

    wait = WebDriverWait(browser, WAIT, ignored_exceptions=[StaleElementReferenceException])  # tables re-render
    find = browser.find_element

    def listed() -> list[tuple[str, str, str]]:
        """(run, tenant, status) of each row of the runs table."""
        rows = browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
        return [
            (r.get_attribute("data-run-id"), *[td.text for td in r.find_elements(By.TAG_NAME, "td")[1:3]]) for r in rows
        ]

    def use_key(key: str) -> None:
        field = find(By.ID, "api-key")
        field.clear()
        field.send_keys(key)
        find(By.ID, "key-save").click()

    browser.get(server.url + "/dashboard")
    use_key(BOB)  # another tenant sees its own run only
    wait.until(lambda _: listed() == [(bob_run, "bob", "active")])
    assert find(By.ID, "runs-total").text == "(1)"

    use_key(ALICE)
    wait.until(lambda _: listed() == [(run, "alice", "active")])
    assert browser.execute_script("return localStorage.getItem('openrl.apiKey')") == ALICE

    # The sessions table: the run's session (one training run, one sampling session), not Bob's.
    def sessions() -> list[tuple[str, list[str]]]:
        rows = find(By.ID, "sessions-table").find_elements(By.CSS_SELECTOR, "tbody tr")
        return [
            (r.get_attribute("data-session-id"), [td.text for td in r.find_elements(By.TAG_NAME, "td")[:5]])
            for r in rows
        ]

    wait.until(lambda _: sessions() == [(session_id, [session_id, "alice", "open", "1", "1"])])

    def open_run(driver) -> bool:  # the table re-renders every few seconds: find, check, click at once
        row = driver.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{run}"]')
        assert row.find_element(By.CSS_SELECTOR, "td.steps").text == "3"
        row.click()
        return True

    wait.until(open_run)

    # The charts redraw on every poll of a live run: each read finds its chart afresh, inside
    # a wait that retries an element replaced between finding it and reading it.
    def drawn(name: str) -> list[tuple[int, float]]:
        points = find(By.CSS_SELECTOR, f'svg[data-chart="{name}"]').find_elements(By.CSS_SELECTOR, "circle.pt")
        return [(int(p.get_attribute("data-x")), float(p.get_attribute("data-y"))) for p in points]

    wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, 'svg[data-chart="loss"][data-points="3"]')))
    wait.until(lambda _: drawn("loss") == list(zip([1, 2, 3], losses)))  # exactly what the SDK was told
    wait.until(lambda _: [y for _x, y in drawn("learning_rate")] == list(LEARNING_RATES))
    for chart in ("grad_norm", "tokens", "step_seconds", "queue_wait_seconds"):
        wait.until(
            lambda _, chart=chart: (
                find(By.CSS_SELECTOR, f'svg[data-chart="{chart}"]').get_attribute("data-points") == "3"
            )
        )
    # Sampling throughput per step: only step 3's window held a sample (the API's number drawn);
    # per request: both samples.
    sampling = api(f"/runs/{run}/sampling")
    assert [(s["step"], s["requests"]) for s in sampling["steps"]] == [(1, 0), (2, 0), (3, 1)]
    assert len(sampling["samples"]) == 2

    wait.until(lambda _: drawn("sampling") == [(3, sampling["steps"][2]["tokens_per_second"])])
    wait.until(
        lambda _: (
            drawn("sampling_requests") == [(i + 1, s["tokens_per_second"]) for i, s in enumerate(sampling["samples"])]
        )
    )
    [checkpoint] = find(By.ID, "checkpoints-table").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert checkpoint.find_element(By.TAG_NAME, "td").text == kept
    checkpoint.find_element(By.CSS_SELECTOR, "button.download").click()
    downloads = tmp_path / "downloads"
    wait.until(lambda _: [f for f in downloads.glob("*.tar")] if downloads.is_dir() else [])
    [archive] = downloads.glob("*.tar")
    served = httpx.get(
        f"{server.url}/api/openrl/v1/checkpoints/archive", params={"path": kept}, headers={"X-API-Key": ALICE}
    )
    wait.until(lambda _: archive.stat().st_size == len(served.content))
    assert archive.read_bytes() == served.content and tarfile.is_tarfile(archive)
    # `openrl serve` runs a timeslicer: this run's turns on the device are drawn.
    wait.until(seen.visibility_of_element_located((By.ID, "timeline-panel")))
    assert find(By.CSS_SELECTOR, "#timeline rect.this")

    # The live stream: its history, then a step taken now.
    wait.until(seen.text_to_be_present_in_element((By.ID, "live"), "live"))
    seen_before = {
        int(li.get_attribute("data-position")) for li in find(By.ID, "events").find_elements(By.TAG_NAME, "li")
    }
    assert seen_before, "the stream starts with the run's recent history"
    training.forward_backward(batch, "cross_entropy").result()
    fresh = '#events li[data-name="training.forward_backward.completed"]'
    wait.until(
        lambda d: any(
            int(li.get_attribute("data-position")) > max(seen_before) for li in d.find_elements(By.CSS_SELECTOR, fresh)
        )
    )
    screenshot(browser, tmp_path, "dashboard-run.png")

    # Fork at step 3 (the field starts at the run's last step): the page names the fork and
    # its state's path, and the server has that fork, made from this run at step 3.
    assert find(By.ID, "fork-step").get_attribute("value") == "3"
    find(By.ID, "run-fork").click()
    fork_link = WebDriverWait(browser, 90).until(seen.presence_of_element_located((By.ID, "fork-run")))
    fork = fork_link.text
    assert fork and fork != run and unquote(fork_link.get_attribute("href")).endswith(f"#/runs/{fork}")
    assert find(By.ID, "fork-path").text == f"tinker://{fork}/weights/forked-at-step-3"
    assert find(By.ID, "action-message").text.startswith(f"Forked at step 3: {fork} (ready)")
    forked = api(f"/runs/{fork}")
    assert forked["run"]["forked_from"] == {"run": run, "step": 3} and forked["run"]["status"] == "active"
    assert f"tinker://{fork}/weights/forked-at-step-3" in [
        c["tinker_path"] for c in api(f"/checkpoints?run_id={fork}")["checkpoints"]
    ]

    cancel = find(By.ID, "run-cancel")
    cancel.click()
    assert cancel.text == "Really cancel?"  # one click alone does not cancel
    cancel.click()
    wait.until(seen.text_to_be_present_in_element((By.ID, "run-status"), "cancelled"))
    assert find(By.ID, "action-message").text.startswith("Cancelled:")
    assert not cancel.is_enabled()
    wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, '#events li[data-name="training.run.cancelled"]')))
    shown = api(f"/runs/{run}")
    assert shown["run"]["status"] == "cancelled" and shown["run"]["cancelled_at"]
    # Its saved checkpoint stays: listed by the API and the page, and it downloads the same bytes.
    assert [c["tinker_path"] for c in shown["checkpoints"]] == [kept]
    wait.until(
        lambda _: (
            [
                r.find_element(By.TAG_NAME, "td").text
                for r in find(By.ID, "checkpoints-table").find_elements(By.CSS_SELECTOR, "tbody tr")
            ]
            == [kept]
        )
    )
    after = httpx.get(
        f"{server.url}/api/openrl/v1/checkpoints/archive", params={"path": kept}, headers={"X-API-Key": ALICE}
    )
    assert after.status_code == 200 and after.content == served.content
    screenshot(browser, tmp_path, "dashboard-cancelled.png")

    # The operator's key sees the run (and its tenant) too.
    browser.get(server.url + "/dashboard#/")
    use_key(OPERATOR)
    wait.until(
        lambda _: set(listed()) == {(run, "alice", "cancelled"), (fork, "alice", "active"), (bob_run, "bob", "active")}
    )
    # No script error and no failed load on the way.
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
