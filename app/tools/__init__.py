"""Tools for the chat: MCP servers (through the official SDK), built-in tools, approval.

Front-end code, engine-agnostic: the app and `edgegem chat` drive the same `ToolBox` (list, switch,
validate, call) and `ApprovalPolicy` (ask, allow, remember). Nothing here imports the engine's
model code; the engine sees only the OpenAI-style tool declarations `ToolSpec.declaration()` gives.
"""
from .approval import ApprovalPolicy, Decision
from .base import ServerState, ServerStatus, ToolResult, ToolSpec
from .config import ConfigError, ServerConfig, ToolsConfig, load_config
from .toolbox import ToolBox

__all__ = ["ApprovalPolicy", "ConfigError", "Decision", "ServerConfig", "ServerState", "ServerStatus", "ToolBox",
           "ToolResult", "ToolSpec", "ToolsConfig", "load_config"]
