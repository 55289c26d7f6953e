"""A small gRPC client: `python -m jaxserve.client "prompt"` streams the answer to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator

import grpc

from jaxserve.proto import jaxserve_pb2 as pb

METHOD = "/jaxserve.v1.Generation/Generate"


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None,
                 root_cert: bytes | None = None):
        self.channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_cert)) if root_cert
                        else grpc.insecure_channel(target))
        self._generate = self.channel.unary_stream(METHOD, request_serializer=pb.GenerateRequest.SerializeToString,
                                                   response_deserializer=pb.GenerateResponse.FromString)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def stream(self, prompt: str | list[int], timeout: float | None = None, request_id: str = "",
               extra: dict | None = None, **sampling) -> Iterator[pb.GenerateResponse]:
        """Yield GenerateResponse messages; sampling takes the SamplingParams names. `extra`: the
        fields the proto has no place for (logit_bias, structured_outputs, ...), sent as the
        `jaxserve-sampling` metadata entry (see jaxserve/server/grpc_server.py)."""
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), request_id=request_id)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        metadata = list(self.metadata or [])
        if extra:
            metadata.append(("jaxserve-sampling", json.dumps(extra)))
        return self._generate(req, timeout=timeout, metadata=metadata or None)

    def generate(self, prompt: str | list[int], **kw) -> tuple[str, pb.GenerateResponse]:
        """Whole text and the last message (finish_reason, usage)."""
        text, last = [], None
        for msg in self.stream(prompt, **kw):
            text.append(msg.text)
            last = msg
        return "".join(text), last

    def close(self) -> None:
        self.channel.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args(argv)
    client = Client(args.target, args.api_key)
    last = None
    for msg in client.stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature):
        sys.stdout.write(msg.text)
        sys.stdout.flush()
        last = msg
    if last is not None:
        u = last.usage
        print(f"\n[{last.finish_reason}; prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
              f"cached {u.cached_prompt_tokens} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
