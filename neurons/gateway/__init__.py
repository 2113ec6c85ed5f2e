"""The organic OpenAI-compatible gateway: settings, API keys and rate limit, OpenAI request
schemas, and the server that sends users' requests to the best miners."""
from neurons.gateway.keys import ApiKeyFileError, ApiKeys, KeyRateLimiter, key_id, read_api_keys
from neurons.gateway.schemas import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_USER_LOGPROBS, ApiError, ChatCompletionBody,
                                     ChatMessage, CompletionBody, RequestBody, parse_body)
from neurons.gateway.server import (GATEWAY_KEY, GatewayServer, MinerDirectory, MinerTarget, OrganicGateway, Outcome,
                                    StopTrimmer, build_gateway_app)
from neurons.gateway.settings import GatewaySettings, GatewaySetupError, gateway_options

__all__ = [
    "ApiKeyFileError", "ApiKeys", "KeyRateLimiter", "key_id", "read_api_keys",
    "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_USER_LOGPROBS", "ApiError", "ChatCompletionBody", "ChatMessage",
    "CompletionBody", "RequestBody", "parse_body",
    "GATEWAY_KEY", "GatewayServer", "MinerDirectory", "MinerTarget", "OrganicGateway", "Outcome", "StopTrimmer",
    "build_gateway_app",
    "GatewaySettings", "GatewaySetupError", "gateway_options",
]
