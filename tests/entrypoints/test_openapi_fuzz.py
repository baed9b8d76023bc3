"""Schema-driven fuzzing of a real `kvserve serve` (schemathesis, bounded): requests generated
from the server's own /openapi.json -- valid and invalid bodies for every route -- never get a
5xx, and every answer's status and media type are ones the document lists. Afterwards the
server is healthy. Bounded: a few examples per operation, loopback only."""
from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance,  # noqa: E402
                                               response_schema_conformance,
                                               status_code_conformance)

from tests.entrypoints.conftest import RemoteServer  # noqa: E402

pytestmark = pytest.mark.timeout(900)
MAX_EXAMPLES = 25


def test_no_5xx_and_answers_match_the_document(server: RemoteServer) -> None:
    schema = schemathesis.openapi.from_url(server.url_for("/openapi.json"))
    calls: dict[str, dict[int, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        seen = calls.setdefault(f"{operation.method.upper()} {operation.path}", {})

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:    # noqa: ANN001 (schemathesis' Case)
            response = case.call(base_url=server.base_url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body,
                                                response.status_code, response.text[:500])
            # Not schemathesis' positive/negative data checks: the server adds bounds the
            # schema cannot state (the context length, n x prompts) and keeps unknown fields
            # (OpenAI clients send newer ones).
            case.validate_response(response, checks=[not_a_server_error,
                                                      status_code_conformance,
                                                      content_type_conformance,
                                                      response_schema_conformance])

        fuzz()
        assert httpx.get(server.url_for("/health"), timeout=30).status_code == 200
    print("fuzzed (status: count):", calls)
    assert sum(sum(v.values()) for v in calls.values()) >= 40
