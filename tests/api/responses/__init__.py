"""The Responses and Conversations APIs, and tool calling on them."""
