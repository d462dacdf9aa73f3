"""`smetric serve` in front of a real disaggregated vLLM pair (CPU build, SmolLM2-135M):
a prefill instance and a decode instance joined by vLLM's ``ExampleConnector`` (a KV store
in files; the CPU build has no NIXL or Mooncake). The decode instance's own
``cached_tokens`` says whether it loaded the prefill's KV instead of computing it.
"""

from __future__ import annotations

import pytest
from real_engines import SYSTEM, find_or_install, post_chat, running_cluster

from smetric.core.headers import DECODE_HEADER, PREFILL_HEADER
from smetric.testing.engines import BLOCK_SIZE, find_vllm, vllm_pd_pair

pytestmark = pytest.mark.real_engine


def test_the_decode_instance_loads_the_prefill_instances_kv(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    install = find_or_install(find_vllm, "setup_vllm.sh", "vLLM (CPU build)", "about 7 minutes")
    # A short folder: vLLM puts IPC sockets under it, and a socket path has 107 bytes at most.
    tmp_path = tmp_path_factory.mktemp("pd")
    prefill, decode = engines = vllm_pd_pair(install, tmp_path)

    def router_args() -> list[str]:
        args = ["--prefill-engine", prefill.url, "--decode-engine", decode.url]
        return [*args, "--block-size", str(BLOCK_SIZE), "--tokenizer", f"hf:{install.model}"]

    with running_cluster(engines, tmp_path, router_args) as cluster:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Explain what the failing test checks, step by step."},
        ]
        data, headers = post_chat(cluster, messages, timeout_s=300)
        assert headers[PREFILL_HEADER] == prefill.url
        assert headers[DECODE_HEADER] == decode.url
        usage = data["usage"]
        assert usage["completion_tokens"] == 8
        # The decode instance never saw this prompt: its whole blocks came from the store.
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == (usage["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
        assert any((tmp_path / "kv-store").rglob("*.safetensors"))
