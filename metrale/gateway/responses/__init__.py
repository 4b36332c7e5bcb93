"""The Responses API's parts: request bodies, input items, stored responses, response objects, events."""
