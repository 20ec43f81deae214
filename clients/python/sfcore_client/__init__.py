"""Client for the sfcore-ai daemon: NDJSON over a Unix socket, standard library only.

    from sfcore_client import Client
    with Client() as client:                      # $SFCORE_SOCKET or /tmp/sfcore-ai.sock
        for piece in client.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)
"""

from ._common import (
    DEFAULT_SOCKET,
    QueuePosition,
    Result,
    SfcoreConnectionError,
    SfcoreError,
    SfcoreTimeoutError,
    Timings,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
    assistant_message,
    function_tool,
    tool_message,
)
from .aio import AsyncClient, AsyncStream
from .client import Client, Stream

__version__ = "0.2.0"
__all__ = ["DEFAULT_SOCKET", "AsyncClient", "AsyncStream", "Client", "QueuePosition", "Result",
           "SfcoreConnectionError", "SfcoreError", "SfcoreTimeoutError", "Stream", "Timings",
           "TokenLogprob", "ToolCall", "TopLogprob", "Usage", "assistant_message",
           "function_tool", "tool_message"]
