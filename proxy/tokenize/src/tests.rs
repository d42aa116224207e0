use std::path::Path;

use super::*;

fn byte_level() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    byte_level::write(dir.path()).unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tokenizer)
}

fn with_template(template: &str) -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    byte_level::write(dir.path()).unwrap();
    let config = serde_json::json!({"chat_template": template, "bos_token": {"content": "<s>"}});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tokenizer)
}

#[test]
fn the_byte_level_tokenizer_gives_each_byte_its_value() {
    let (_dir, tokenizer) = byte_level();
    let text = "héllo, wörld\n\t~ \u{1f600}";
    let ids = tokenizer.encode(text, true).unwrap();
    let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
    assert_eq!(ids, bytes);
}

#[test]
fn a_chat_is_rendered_then_encoded_without_special_tokens() {
    let (_dir, tokenizer) = byte_level();
    let messages = r#"[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"there"}]}]"#;
    let request = ChatRequest::new(messages);
    let text = tokenizer.render_chat(&request).unwrap();
    assert_eq!(
        text,
        "<|system|>Be brief.<|end|><|user|>Hi\nthere<|end|><|assistant|>"
    );
    let ids = tokenizer.encode_chat(&request).unwrap();
    assert_eq!(ids.len(), text.len());
    let without = ChatRequest {
        add_generation_prompt: false,
        ..request
    };
    assert!(!tokenizer
        .render_chat(&without)
        .unwrap()
        .ends_with("<|assistant|>"));
}

#[test]
fn templates_get_python_behaviour() {
    let template = "{{ bos_token }}{% for m in messages %}{{ m.role.upper() }}: {{ m.content.strip() }}\n\
        {% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}{% endfor %}\
        {% if tools %}{{ tools | tojson }}{% endif %}{{ flavour }}";
    let (_dir, tokenizer) = with_template(template);
    let messages = r#"[{"role":"user","content":"  hi  "},
        {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function",
        "function":{"name":"f","arguments":"{\"z\": 1, \"a\": \"é\"}"}}]}]"#;
    let request = ChatRequest {
        tools: Some(r#"[{"type":"function","function":{"name":"f"}}]"#),
        chat_template_kwargs: Some(r#"{"flavour":"!"}"#),
        ..ChatRequest::new(messages)
    };
    assert_eq!(
        tokenizer.render_chat(&request).unwrap(),
        "<s>USER: hi\nASSISTANT: \n{\"z\": 1, \"a\": \"é\"}\
         [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]!"
    );
}

#[test]
fn templates_that_loop_over_parts_get_parts() {
    let template = "{% for m in messages %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endfor %}";
    let (_dir, tokenizer) = with_template(template);
    let messages = r#"[{"role":"user","content":"one"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]"#;
    assert_eq!(
        tokenizer.render_chat(&ChatRequest::new(messages)).unwrap(),
        "[one][a][b]"
    );
}

#[test]
fn continue_final_message_ends_inside_the_last_message() {
    let (_dir, tokenizer) = byte_level();
    let messages = r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello, I"}]"#;
    let request = ChatRequest {
        continue_final_message: true,
        ..ChatRequest::new(messages)
    };
    assert_eq!(
        tokenizer.render_chat(&request).unwrap(),
        "<|user|>Hi<|end|><|assistant|>Hello, I"
    );
}

#[test]
fn what_cannot_be_rendered_here_says_why() {
    let (_dir, tokenizer) = byte_level();
    let image = r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#;
    let err = tokenizer.render_chat(&ChatRequest::new(image)).unwrap_err();
    assert!(matches!(err, TokenizeError::Unsupported(_)), "{err}");
    let raise = with_template("{{ raise_exception('roles must alternate') }}").1;
    let err = raise.render_chat(&ChatRequest::new("[]")).unwrap_err();
    assert!(err.to_string().contains("roles must alternate"), "{err}");
    let missing = Tokenizer::from_dir(Path::new("/nonexistent")).unwrap_err();
    assert!(missing.to_string().contains("tokenizer.json"), "{missing}");
    let dir = tempfile::tempdir().unwrap();
    byte_level::write(dir.path()).unwrap();
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let plain = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(matches!(
        plain.render_chat(&ChatRequest::new("[]")),
        Err(TokenizeError::NoChatTemplate)
    ));
}

#[test]
fn a_request_with_tools_uses_the_tool_use_template() {
    let dir = tempfile::tempdir().unwrap();
    byte_level::write(dir.path()).unwrap();
    let config = serde_json::json!({"chat_template": [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let messages = r#"[{"role":"user","content":"hi"}]"#;
    assert_eq!(
        tokenizer.render_chat(&ChatRequest::new(messages)).unwrap(),
        "plain:hi"
    );
    let with_tools = ChatRequest {
        tools: Some(r#"[{"type":"function","function":{"name":"f"}}]"#),
        ..ChatRequest::new(messages)
    };
    assert_eq!(tokenizer.render_chat(&with_tools).unwrap(), "tools:1:hi");
    // A chat_template.jinja file beside it replaces the default, keeps the named ones.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "file:{{ messages[0].content }}",
    )
    .unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tokenizer.render_chat(&ChatRequest::new(messages)).unwrap(),
        "file:hi"
    );
    assert_eq!(tokenizer.render_chat(&with_tools).unwrap(), "tools:1:hi");
}
