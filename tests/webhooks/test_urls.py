"""The SSRF guard: which webhook URLs the server agrees to call."""

from __future__ import annotations

import ipaddress

import pytest

from api.settings import Settings
from api.webhook_urls import UrlPolicy, WebhookUrlRefused, check_webhook_url, pinned_target

DNS = {
    "hooks.example.com": ["93.184.216.34"],
    "metadata.example.com": ["169.254.169.254"],
    "intranet.example.com": ["10.1.2.3"],
    "mixed.example.com": ["93.184.216.34", "192.168.1.10"],
    "v6.example.com": ["2606:2800:220:1:248:1893:25c8:1946"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
    "cgnat.example.com": ["100.64.0.7"],
}


def fake_resolver(host: str, _port: int) -> list[str]:
    if host not in DNS:
        raise OSError("Name or service not known")
    return DNS[host]


DEFAULT = UrlPolicy()


def refusal(url: str, policy: UrlPolicy = DEFAULT) -> str | None:
    try:
        check_webhook_url(url, policy, fake_resolver)
    except WebhookUrlRefused as exc:
        assert exc.field == "url" and exc.status == 422
        return exc.message
    return None


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/x",
        "http://hooks.example.com:8080/x?y=1",
        "https://v6.example.com/",
        "https://93.184.216.34/",
    ],
)
def test_public_urls_pass(url: str) -> None:
    assert refusal(url) is None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://hooks.example.com/x", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("https:///nohost", "names no host"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https://hooks.example.com:99999/", "not a valid URL"),
        ("https://nowhere.example.com/", "cannot resolve"),
        ("http://127.0.0.1:8000/v1/runs", "loopback"),
        ("http://[::1]/", "loopback"),
        ("http://mapped.example.com/", "loopback"),
        ("http://metadata.example.com/latest/meta-data", "169.254.169.254 is not a public address"),
        ("http://169.254.169.254/", "not a public address"),
        ("http://intranet.example.com/", "10.1.2.3 is not a public address"),
        ("http://mixed.example.com/", "192.168.1.10 is not a public address"),
        ("http://cgnat.example.com/", "not a public address"),
        ("http://0.0.0.0:8000/", "not a public address"),
        ("http://224.0.0.1/", "not a public address"),
    ],
)
def test_internal_and_malformed_urls_are_refused(url: str, reason: str) -> None:
    message = refusal(url)
    assert message is not None and reason in message, message


def test_loopback_and_private_networks_only_when_configured() -> None:
    loopback = UrlPolicy(allow_loopback=True)
    assert refusal("http://127.0.0.1:9/", loopback) is None
    assert refusal("http://mapped.example.com/", loopback) is None
    assert refusal("http://intranet.example.com/", loopback) is not None  # loopback only, not 10/8
    private = UrlPolicy(allowed_networks=(ipaddress.ip_network("10.1.0.0/16"),))
    assert refusal("http://intranet.example.com/", private) is None
    assert refusal("http://127.0.0.1/", private) is not None
    assert refusal("http://mixed.example.com/", private) is not None  # 192.168/16 is still outside


def test_host_allow_list() -> None:
    policy = UrlPolicy(allowed_hosts=("hooks.example.com", "*.partner.example"))
    assert refusal("https://hooks.example.com/", policy) is None
    assert "allow-list" in (refusal("https://v6.example.com/", policy) or "")
    DNS["ci.partner.example"] = ["93.184.216.35"]
    assert refusal("https://ci.partner.example/", policy) is None
    assert "allow-list" in (refusal("https://partner.example.evil.com/", policy) or "")


def test_settings_build_the_policy_and_refuse_bad_networks() -> None:
    policy = UrlPolicy.from_settings(
        Settings(webhook_allowed_hosts=["Hooks.Example.com."], webhook_allowed_networks=["10.0.0.0/8"])
    )
    assert policy.allowed_hosts == ("hooks.example.com",) and not policy.allow_loopback
    assert policy.allowed_networks == (ipaddress.ip_network("10.0.0.0/8"),)
    with pytest.raises(ValueError, match="not-a-net"):
        Settings(webhook_allowed_networks=["not-a-net"])


def test_the_real_resolver_sees_localhost_as_loopback() -> None:
    with pytest.raises(WebhookUrlRefused, match="loopback"):
        check_webhook_url("http://localhost:8000/", UrlPolicy())
    assert check_webhook_url("http://localhost:8000/", UrlPolicy(allow_loopback=True)) in ("127.0.0.1", "::1")


def test_attempts_connect_to_the_checked_address() -> None:
    target = pinned_target("https://hooks.example.com:8443/a/b?c=1", "93.184.216.34")
    assert target.url == "https://93.184.216.34:8443/a/b?c=1"
    assert target.host_header == "hooks.example.com:8443" and target.server_name == "hooks.example.com"
    v6 = pinned_target("http://v6.example.com/x", "2606:2800:220:1:248:1893:25c8:1946")
    assert v6.url == "http://[2606:2800:220:1:248:1893:25c8:1946]/x" and v6.host_header == "v6.example.com"
