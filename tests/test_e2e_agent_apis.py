"""The agent APIs (#37) against real services (a gateway and a combined worker, the tiny model): Anthropic's
Messages and OpenAI's Responses reuse the prefix cache a shared conversation builds, and say so in their usage."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.test_structured import System, combined_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
LONG_SYSTEM = "You are a careful assistant who answers about windserve. " * 12


@pytest.fixture(scope="module")
def system(nats_server, tmp_path_factory) -> Iterator[System]:
    yield from combined_system(nats_server.url, tmp_path_factory.mktemp("agent_apis"), "ag")


def test_a_repeated_system_prompt_is_read_from_the_cache(system):
    client = anthropic.Anthropic(base_url=system.url, api_key="none", max_retries=0, timeout=60)
    asks = [[{"role": "user", "content": "first"}], [{"role": "user", "content": "second"}]]
    first, second = (client.messages.create(model="windserve-tiny", max_tokens=4, system=LONG_SYSTEM, messages=m)
                     for m in asks)
    assert first.content[0].type == "text" and second.usage.input_tokens > 100
    assert second.usage.cache_read_input_tokens > 64  # the shared system prompt's pages (16 tokens each)
    streamed = client.messages.create(model="windserve-tiny", max_tokens=4, system=LONG_SYSTEM, messages=asks[0],
                                      stream=True)
    kinds = [event.type for event in streamed]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_previous_response_id_hits_the_prefix_cache(system):
    client = system.client()
    first = client.responses.create(model="windserve-tiny", input=LONG_SYSTEM + "What is it?", max_output_tokens=6)
    second = client.responses.create(model="windserve-tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 64
