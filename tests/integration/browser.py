"""A real browser for the console's tests: Debian's chromium, headless, driven by Selenium through
Debian's chromedriver (nothing is downloaded: both come from apt, installed by ./dev)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

T = TypeVar("T")


def chromium_available() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


class Browser:
    """One browser window: its own profile, hence its own cookies (one signed-in person)."""

    def __init__(self, profile: Path, shots: Path, name: str, javascript: bool = True) -> None:
        opts = Options()
        if not javascript:  # a page as a browser without scripts (or with them blocked) shows it
            opts.add_argument("--blink-settings=scriptEnabled=false")
        opts.binary_location = str(shutil.which("chromium"))
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                    f"--user-data-dir={profile}", "--no-first-run", "--disable-gpu"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(shutil.which("chromedriver"))))
        self.shots = shots
        self.name = name

    def quit(self) -> None:
        with contextlib.suppress(WebDriverException):
            self.driver.quit()

    def open(self, url: str) -> None:
        self.driver.get(url)

    def text(self, css: str) -> str:
        """The element's text; found again when a live update replaced it between the find and the read."""
        found: list[str] = []
        self._again(lambda: found.append(str(self.driver.find_element(By.CSS_SELECTOR, css).text)))
        return found[-1]

    def attribute(self, css: str, name: str) -> str:
        found: list[str] = []
        self._again(lambda: found.append(str(self.driver.find_element(By.CSS_SELECTOR, css).get_attribute(name))))
        return found[-1]

    def has(self, css: str) -> bool:
        return bool(self.driver.find_elements(By.CSS_SELECTOR, css))

    def _again(self, act: Callable[[], None]) -> None:
        """``act`` on an element a live update may have replaced meanwhile: found again, as a person's
        next click lands on what the page shows now."""
        for attempt in range(5):
            try:
                act()
                return
            except StaleElementReferenceException:
                if attempt == 4:
                    raise

    def click(self, css: str) -> None:
        self._again(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())

    def type(self, css: str, text: str) -> None:
        def act() -> None:
            el = self.driver.find_element(By.CSS_SELECTOR, css)
            el.clear()
            el.send_keys(text)

        self._again(act)

    def wait(self, check: Callable[[], T], timeout: float, what: str) -> T:
        """The first true value of ``check`` (which reads the page), within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            # A page being replaced (a live update, or the next page of a posted form still loading)
            # is not the page waited for yet.
            with contextlib.suppress(StaleElementReferenceException, NoSuchElementException):
                value = check()
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: timed out after {timeout:.0f}s waiting for {what} "
                                     f"(page {self.driver.current_url}; screenshot {self.screenshot(what)})")
            time.sleep(0.05)  # polling the page's DOM, the condition is what is waited for

    def alert_shown(self) -> bool:
        try:
            self.driver.switch_to.alert  # noqa: B018 - raises when there is none
        except NoAlertPresentException:
            return False
        return True

    def wrapped(self, css: str) -> list[str]:
        """The texts of the elements matching ``css`` that the page breaks over more than one line."""
        script = """return Array.from(document.querySelectorAll(arguments[0])).filter(el => {
            const range = document.createRange(); range.selectNodeContents(el);
            const tops = new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top)));
            return tops.size > 1; }).map(el => el.textContent);"""
        return [str(t) for t in self.driver.execute_script(script, css)]

    def width(self, css: str) -> float:
        """The rendered width, in CSS pixels, of the first element matching ``css``."""
        return float(self.driver.execute_script(
            "return document.querySelector(arguments[0]).getBoundingClientRect().width;", css))

    def resize(self, width: int, height: int) -> None:
        self.driver.set_window_size(width, height)

    def screenshot(self, label: str) -> Path:
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{self.name}-{''.join(c if c.isalnum() else '-' for c in label)[:60]}.png"
        self.driver.save_screenshot(str(path))
        return path


@contextlib.contextmanager
def browser(tmp: Path, name: str, javascript: bool = True) -> Iterator[Browser]:
    b = Browser(tmp / f"profile-{name}", tmp / "screenshots", name, javascript)
    try:
        yield b
    except BaseException:
        with contextlib.suppress(WebDriverException):
            print(f"screenshot of {name} at the failure: {b.screenshot('failure')}")
        raise
    finally:
        b.quit()
