claude mcp add --transport http cube \
  "https://cube.example.internal:18080/mcp?profile=offline-code&runtime=mcp" \
  --header "Authorization: Bearer $CUBE_ADAPTER_TOKEN"
