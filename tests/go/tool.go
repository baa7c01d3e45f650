// A payment tool in Go, written as tools are: Stripe's PaymentIntents with net/http's default
// client and the secret key from STRIPE_API_KEY. Nothing here names the proxy or its CA: the
// worker's environment does (tests/it/sdk_matrix.rs). One invocation is one run of the tool.
//
//	tool INVOICE AMOUNT
//
// Prints one JSON line: {"status", "id", "replayed"}, or {"error"}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
)

func main() {
	form := url.Values{
		"amount":               {os.Args[2]},
		"currency":             {"usd"},
		"payment_method":       {"pm_card_visa"},
		"confirm":              {"true"},
		"metadata[invoice_id]": {os.Args[1]},
	}
	req, err := http.NewRequest("POST", "https://api.stripe.com/v1/payment_intents", strings.NewReader(form.Encode()))
	if err != nil {
		fail(err)
	}
	req.Header.Set("Authorization", "Bearer "+os.Getenv("STRIPE_API_KEY"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		fail(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		fail(err)
	}
	var payload struct {
		ID string `json:"id"`
	}
	_ = json.Unmarshal(body, &payload)
	out, _ := json.Marshal(map[string]any{
		"status":   resp.StatusCode,
		"id":       payload.ID,
		"replayed": resp.Header.Get("Idempotent-Replayed"),
	})
	fmt.Println(string(out))
}

func fail(err error) {
	out, _ := json.Marshal(map[string]string{"error": fmt.Sprintf("%T", err), "message": err.Error()})
	fmt.Println(string(out))
	os.Exit(0)
}
