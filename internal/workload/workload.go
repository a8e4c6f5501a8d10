// Package workload makes the saved responses that idem's benchmarks and
// size tests store: shaped like a payment API's, with random ids, so that
// what compression achieves on them is what it achieves on real ones.
package workload

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
)

func id(prefix string, n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// Payment returns a JSON payment object of about 1 KiB, the n-th of a
// series: random ids (payment, customer, charge, method, receipt), amounts,
// dates and card details that vary, field names and enums that do not.
func Payment(n int) []byte {
	amount := 100 + mrand.IntN(100000)
	return []byte(fmt.Sprintf(`{"id":%q,"object":"payment_intent","amount":%d,"amount_received":%d,"currency":"eur",`+
		`"status":"succeeded","created":%d,"customer":%q,"description":"Order #%d","latest_charge":%q,"livemode":true,`+
		`"metadata":{"order_id":"%d","shop":"shop-%d"},"payment_method":%q,"payment_method_types":["card"],`+
		`"receipt_email":"user%d@example.com","charges":{"object":"list","data":[{"id":%q,"object":"charge","amount":%d,`+
		`"captured":true,"paid":true,"receipt_url":"https://pay.example.com/receipts/%s","outcome":{"network_status":`+
		`"approved_by_network","risk_level":"normal","risk_score":%d,"seller_message":"Payment complete.","type":"authorized"},`+
		`"payment_method_details":{"card":{"brand":"visa","country":"DE","exp_month":%d,"exp_year":%d,"funding":"credit",`+
		`"last4":"%04d","network":"visa"},"type":"card"}}],"has_more":false},"next_action":null,"shipping":null,`+
		`"statement_descriptor":null}`,
		id("pi_", 12), amount, amount, 1_790_000_000+n, id("cus_", 7), n, id("ch_", 12), n, n%500, id("pm_", 12),
		mrand.IntN(100000), id("ch_", 12), amount, id("", 20), mrand.IntN(100), 1+mrand.IntN(12), 2027+mrand.IntN(6),
		mrand.IntN(10000)))
}

// PaymentHeaders returns the response headers saved with a Payment.
func PaymentHeaders() map[string][]string {
	return map[string][]string{
		"Content-Type":  {"application/json"},
		"Cache-Control": {"no-store"},
		"Request-Id":    {id("req_", 12)},
	}
}
