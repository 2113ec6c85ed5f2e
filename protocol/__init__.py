"""The subnet's wire protocol: schemas, btauth/1 signing, response signatures,
and the HTTP client validators use to call miners. Knows nothing of the
engine or the chain."""
from .auth import AUTH_ALLOWED_SKEW_S, AUTH_MAX_AGE_S, AuthFailure, SQLiteNonceStore, sign_request, verify_request
from .client import (ClientTimeouts, GenerateResult, MinerClient, MinerError, MinerHTTPError, MinerProtocolError,
                     MinerStreamError, MinerTimeout, MinerUnreachable, TimedEvent)
from .errors import HTTP_STATUS, ErrorCode, http_status
from .schemas import (CAPABILITIES_PATH, DEFAULT_LIMITS, GENERATE_PATH, HEALTH_PATH, JSON_CONTENT_TYPE,
                      NDJSON_CONTENT_TYPE, PROTOCOL_VERSION, SCORE_PATH, Capabilities, ErrorBody, ErrorEvent,
                      FinalMessage, GenerateRequest, Health, Limits, ProtocolError, ResponseSignature,
                      ScoredPositionMessage, ScoreRequest, ScoreResponse, StreamEvent, Timings, TokenMessage,
                      TopLogprob, Usage, decode_event, encode_event, encode_model, error_body, parse_generate,
                      parse_score)
from .signature import encode_token_ids, response_digest, sign_response, verify_response
